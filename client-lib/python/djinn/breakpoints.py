"""Breakpoints: a run stopped after a block, waiting on its node to be resumed or aborted."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from ._wire import CallTensors, unflatten
from .errors import DjinnError, HandleLostError, NotFoundError, StaleHandleError

if TYPE_CHECKING:
    from .client import Client


class Paused:
    """A run of a remote model stopped after block `block`: the request waits on its node,
    holding no worker, with that block's output (the activation) kept in device memory.

        p = rm.run_until(2, x)     # blocks 0, 1, 2 run
        a = p.activation           # block 2's output: a tensor, or a tuple if the block returns several
                                   # (a graph's: a dict of what block 2 passes on, by name)
        y = p.resume()             # blocks 3.. run on the kept activation; y is what rm(x) returns
        y = p.resume(a + delta)    # ... or on a replacement of the same structure, shapes and dtypes
        q = p.resume(until=5)      # ... or stop again after block 5 (a new Paused)
        p.abort()                  # ... or drop it

    A Paused is resumed or aborted once; a resume whose blocks fail (ExecutionError) or whose
    replacement does not match (BreakpointError) leaves it parked, to try again. The node
    releases a request parked longer than its `--parked-ttl`, and one dropped here unresumed
    is aborted with the client's next call."""

    __module__ = "djinn"
    __slots__ = ("block", "_client", "_native", "_activation", "_fetched", "_done", "_graph")

    def __init__(self, client: Client, native, block: int, activation, fetched: bool, graph=None):
        self.block = block
        self._client = client
        self._native = native
        # A model registered as a graph names what each block passes on, and shapes its output.
        self._graph = graph
        self._activation = self._named(unflatten(activation, client)) if fetched else None
        self._fetched = fetched
        self._done = False

    def _named(self, activation):
        return activation if self._graph is None else self._graph.activation(self.block, activation)

    @property
    def node(self) -> str:
        """The address of the node the request is parked on."""
        return self._native.node

    @property
    def activation(self):
        """Block `block`'s output, as the next block receives it (fetched from the node on
        first use when `run_until(..., fetch=False)`)."""
        if not self._fetched:
            self._check()
            self._activation = self._named(unflatten(self._client._native.inspect(self._native), self._client))
            self._fetched = True
        return self._activation

    def resume(self, activation=None, until: Optional[int] = None, fetch: bool = True):
        """Runs the remaining blocks, on the kept activation or on `activation`, and returns
        the model's output; with `until`, stops again after that block and returns a new
        Paused (`fetch` as for `run_until`)."""
        self._check()
        if activation is not None and self._graph is not None:
            activation = self._graph.replacement(self.block, activation)
        call = CallTensors()
        wire = None if activation is None else call.flatten(activation)
        if call.nodes:
            raise DjinnError("a replacement activation is made of tensors sent with the resume, not RemoteTensors")
        try:
            parked, out = self._client._native.resume(
                self._native, wire, call.tensors, None if until is None else int(until), fetch
            )
        except (NotFoundError, StaleHandleError, HandleLostError):
            self._done = True
            raise
        self._done = True
        if parked is None:
            out = unflatten(out, self._client)
            return out if self._graph is None else self._graph.outputs(list(out) if isinstance(out, tuple) else [out])
        return Paused(self._client, parked, int(until), out, fetch, self._graph)

    def abort(self) -> None:
        """Drops the request (a session step's state stays as it was before the step)."""
        if not self._done:
            self._done = True
            try:
                self._client._native.abort(self._native)
            except (NotFoundError, HandleLostError):
                pass

    def _check(self) -> None:
        if self._done:
            raise DjinnError(f"{self!r} was resumed or aborted already")

    def __del__(self):
        if not getattr(self, "_done", True):
            try:
                self._client._native.abort_later(self._native)
            except Exception:  # interpreter shutdown: the node's --parked-ttl releases it
                pass

    def __repr__(self) -> str:
        state = "done" if self._done else f"parked on {self.node}"
        return f"Paused(after block {self.block}, {state})"
