"""Sessions: a model's state (a KV cache, a position) kept on its node between calls."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

from ._wire import CallTensors, unflatten
from .breakpoints import Paused
from .errors import DjinnError, HandleLostError

if TYPE_CHECKING:
    from .models import RemoteModel


def session(model: RemoteModel, *state: torch.Tensor, reserve: int = 0, key: Optional[str] = None) -> "Session":
    """Opens a session of `model` on its node, with `state` (tensors: a KV cache, a position)
    as its initial state. See `Session`."""
    return Session(model, state, reserve, key)


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
    session by, as it places calls made with that id; the record follows the session's moves."""

    __module__ = "djinn"
    __slots__ = ("model", "_client", "_native", "_closed")

    def __init__(
        self, model: RemoteModel, state: Sequence[torch.Tensor], reserve: int = 0, key: Optional[str] = None
    ):
        call = CallTensors()
        for t in state:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"a session's state is tensors, not a {type(t).__name__}")
            call.flatten(t)
        self.model = model
        self._client = model._client
        self._closed = True
        self._native = self._client._native.session_open(model.fingerprint, call.tensors, reserve, key)
        self._closed = False

    @property
    def node(self) -> str:
        """The address of the node that holds the session's state."""
        return self._native.node

    def step(self, *inputs, **kwargs):
        """Runs the model on `inputs` and the session's state; returns the outputs (a graph
        takes its inputs as the model's forward does, keywords too)."""
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
