"""Sessions: a model's state (a KV cache, a position) kept on its node between calls."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from ._wire import CallTensors, unflatten
from .breakpoints import Paused
from .errors import DjinnError, HandleLostError

if TYPE_CHECKING:
    from .models import RemoteModel


def session(
    model: RemoteModel,
    *state: torch.Tensor,
    reserve: int = 0,
    key: Optional[str] = None,
    prefill: Optional[str] = None,
    decode: Optional[str] = None,
    decode_steps: int = 64,
) -> "Session":
    """Opens a session of `model` on its node, with `state` (tensors: a KV cache, a position)
    as its initial state. See `Session`."""
    return Session(model, state, reserve, key, prefill, decode, decode_steps)


class Session:
    """State that stays in a node's device memory between calls of a model, such as an LLM
    agent's KV cache. Each step runs `model(*inputs, *state)` on the node; the model returns
    `(*outputs, *new_state)`, the new state stays there and the outputs come back (one output
    alone, unwrapped). A model registered as a graph with a cache (`cache_len=`) keeps its
    cache as the state: each step sends only its new tokens, and the node writes their keys and
    values into the cache where it is.

        with djinn.session(rm, cache, position) as s:
            logits = s.step(tokens)
            s.io_wait(800)   # the agent waits ~800 ms on a tool: the node moves the state to host memory
            s.compute()      # it is back: the node restores the state (the next step would too)

    Signals and steps take effect on the node in the order sent. `reserve`: device bytes to
    hold for the state as it grows (the node charges the larger of the two). Closing frees the
    state; a session never closed (its client died) is closed by the node after its
    `--session-idle-timeout`. `move(node)` moves the session to another node, node to node
    (prefill on one node, decode on another); otherwise, if its node dies, the state is lost
    with it (HandleLostError). Under a control plane, `key` is the session id it places the
    session by, as it places calls made with that id; the record follows the session's moves.

    Prefill on one node, decode on another: with `prefill="auto"` the session opens where the
    control plane places the model's prefill (compute-bound: the most FLOP/s), and with
    `decode="auto"` it moves, before its second step, to where the control plane places its
    decode (bound by reading memory: the best bandwidth with room for the state), weighing the
    move (the state over the link, paid over `decode_steps`) against what the other node saves;
    either may name a node instead. The control plane's decisions are in `placements`.

        with rm.session(prefill="auto", decode="auto") as s:
            logits = s.step(input_ids=prompt)   # the prompt, on the compute node
            logits = s.step(input_ids=token)    # moved first, if the decode is placed elsewhere"""

    __module__ = "djinn"
    __slots__ = ("model", "placements", "_client", "_native", "_closed", "_state_bytes", "_decode", "_decode_steps",
                 "_steps")

    def __init__(
        self,
        model: RemoteModel,
        state: Sequence[torch.Tensor],
        reserve: int = 0,
        key: Optional[str] = None,
        prefill: Optional[str] = None,
        decode: Optional[str] = None,
        decode_steps: int = 64,
    ):
        call = CallTensors()
        for t in state:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"a session's state is tensors, not a {type(t).__name__}")
            call.flatten(t)
        self.model = model
        self._client = model._client
        self._closed = True
        graph_bytes = model._graph.state_bytes if model._graph is not None else 0
        self._state_bytes = max(reserve, sum(t.numel() * t.element_size() for t in state) or graph_bytes)
        self._decode, self._decode_steps, self._steps = decode, decode_steps, 0
        # The control plane's decisions for this session's phases, in order.
        self.placements = []
        node = None
        if prefill is not None:
            if key is not None:
                raise DjinnError("a session placed by phase has no key: give prefill= and decode=, or key=")
            node = self._node_for(prefill, "prefill")
        self._native = self._client._native.session_open(model.fingerprint, call.tensors, reserve, key, node)
        self._closed = False

    @property
    def node(self) -> str:
        """The address of the node that holds the session's state."""
        return self._native.node

    def step(self, *inputs, **kwargs):
        """Runs the model on `inputs` and the session's state; returns the outputs (a graph
        takes its inputs as the model's forward does, keywords too). With `decode=`, the first
        step is the prefill: before the second, the session moves where its decode goes."""
        if self._steps == 1 and self._decode is not None:
            self.move(self._node_for(self._decode, "decode"))
        self._steps += 1
        graph = self.model._graph
        if graph is not None:
            inputs = tuple(graph.call_tensors(inputs, kwargs))
        elif kwargs:
            raise TypeError("keyword inputs are for models registered as graphs")
        wire, call = self._inputs(inputs)
        out = unflatten(self._client._native.session_step(self._native, wire, call.tensors), self._client)
        if graph is None:
            return out
        return graph.outputs(list(out) if isinstance(out, tuple) else [out])

    def step_until(self, block: int, *inputs, fetch: bool = True) -> "Paused":
        """A step stopped after block `block` (see `Paused`): its activation includes the
        state as the blocks pass it on. Resumed to its end, the step returns its outputs and
        the new state stays on the node; aborted, the state stays as it was. The session's
        later steps and signals wait until then."""
        wire, call = self._inputs(inputs)
        parked, activation = self._client._native.session_step_until(
            self._native, wire, call.tensors, int(block), fetch
        )
        return Paused(self._client, parked, int(block), activation, fetch)

    def _inputs(self, inputs: tuple) -> tuple[list, CallTensors]:
        self._check()
        call = CallTensors()
        wire = [call.flatten(v) for v in inputs]
        if any(n != self.node for n in call.nodes):
            raise DjinnError(f"RemoteTensor inputs of a session must be on its node ({self.node})")
        return wire, call

    def move(self, node: str) -> None:
        """Moves the session to `node` (an address, or a node's name under a control plane):
        its earlier steps and signals finish where it is, then its state goes to `node` node to
        node (over RDMA where both have it; never through this client), and the session goes on
        there from where it was. The target gets the model from this client when it lacks it.
        Steps sent meanwhile by other clients wait for the move and follow it. If the move
        fails, the session stays where it was, whole, and this raises why. A step of it parked
        at a breakpoint must be resumed or aborted first."""
        self._check()
        self._client._native.session_move(self._native, self._address_of(node))

    def _node_for(self, node: str, phase: str) -> str:
        """`node`'s address; for "auto", where the control plane places this model's calls in
        `phase` (a decode weighing the move of this session's state from where it is, paid
        over its decode steps). The decision is kept in `placements`."""
        if node != "auto":
            return self._address_of(node)
        moving = {} if phase == "prefill" else {
            "moving_from": self.node, "state_bytes": self._state_bytes, "calls": self._decode_steps}
        decision = json.loads(self._client._native.place_calls(self.model.fingerprint, phase, **moving))
        self.placements.append(decision)
        return decision["addr"]

    def _address_of(self, node: str) -> str:
        if ":" in node:
            return node
        for n in self._client.cluster()["nodes"]:
            if n["name"] == node:
                return n["inventory"]["addr"]
        raise DjinnError(f"no live node named {node!r}")

    def io_wait(self, expected_ms: Optional[int] = None) -> None:
        """The agent waits on something else (a tool, a user), for about `expected_ms` when
        known: the node may move the state to host memory, and brings it back ahead of then."""
        self._check()
        self._client._native.session_io_wait(self._native, None if expected_ms is None else int(expected_ms))

    def compute(self) -> None:
        """The agent is about to step again: the node brings the state back now."""
        self._check()
        self._client._native.session_compute(self._native)

    def close(self) -> None:
        """Frees the state on the node (if the node is gone, the state went with it)."""
        if not self._closed:
            self._closed = True
            try:
                self._client._native.session_close(self._native)
            except HandleLostError:
                pass

    def _check(self) -> None:
        if self._closed:
            raise DjinnError(f"{self!r} is closed")

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            try:
                self._client._native.close_later(self._native)
            except Exception:  # interpreter shutdown: the node's idle timeout closes it
                pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"on {self.node}"
        return f"Session({self.model.fingerprint[:16]}…, {state})"
