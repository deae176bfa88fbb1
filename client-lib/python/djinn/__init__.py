"""Run PyTorch models on a Djinn node as if they were local.

    import djinn
    djinn.init("http://127.0.0.1:7000")          # the control plane (`djinn up`), or a node's HOST:PORT
    rm = djinn.register(model, example_inputs)   # placed by the control plane, uploaded once
    y = rm(x)                                     # sends only the fingerprint and x
    h = rm(x, keep=True)                          # the output stays on the node: a RemoteTensor
    z = rm2(h).cpu()                              # h is used where it is, without crossing the network
    p = rm.run_until(2, x)                        # stop after block 2: p.activation, p.resume(...), p.abort()

A model is an ordered list of TorchScript blocks: `nn.Sequential` becomes one block per
layer, and any model can be split with `blocks=[...]` (submodules or callables, in execution
order). A block's tuple output becomes the next block's positional arguments. Registration
checks that the blocks, chained, reproduce the model's own output on the example inputs.
"""

from __future__ import annotations

import io
import json
import math
import os
import threading
import warnings
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from . import _native
from ._native import (
    AuthenticationError,
    BadArchiveError,
    BreakpointError,
    ControlPlaneError,
    DjinnError,
    ExecutionError,
    HandleLostError,
    NotFoundError,
    OverBudgetError,
    QuotaExceededError,
    RemoteError,
    StaleHandleError,
    TransportError,
    UnknownModelError,
)

__all__ = [
    "AuthenticationError",
    "BadArchiveError",
    "BlockMismatchError",
    "BreakpointError",
    "Client",
    "ControlPlaneError",
    "DjinnError",
    "ExecutionError",
    "HandleLostError",
    "NotFoundError",
    "OverBudgetError",
    "Paused",
    "QuotaExceededError",
    "RemoteError",
    "RemoteModel",
    "RemoteTensor",
    "Session",
    "StaleHandleError",
    "TransportError",
    "UnknownModelError",
    "UnsupportedOperationError",
    "LazyTensor",
    "capture",
    "get_graph",
    "init",
    "register",
    "remote",
    "session",
    "stats",
    "status",
]


class BlockMismatchError(DjinnError, ValueError):
    """The blocks given, run in order, do not reproduce the model's output."""


_WIRE_DTYPES = {
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float32: "f32",
    torch.float64: "f64",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.bool: "bool",
}
_TORCH_DTYPES = {name: dtype for dtype, name in _WIRE_DTYPES.items()}


class Client:
    """A cluster reached through its control plane, or one node alone. `djinn.init` makes the
    default one."""

    def __init__(
        self,
        address: str,
        timeout: float = 60.0,
        transport: str = "auto",
        failover: float = 30.0,
        token: Optional[str] = None,
    ):
        """`address`: the control plane's "http://HOST:PORT" (models go where it places them,
        and move to another node when theirs dies), or a node's "HOST:PORT" (a bare HOST:PORT
        that serves HTTP is taken as a control plane). `transport`: "auto" (RDMA when both ends
        have it, else TCP), "rdma" or "tcp". `failover`: seconds a call may spend finding a
        live node when its node dies. `token`: the tenant's token, where the cluster needs
        one (default: the DJINN_TOKEN environment variable); models, tensors and sessions are
        then the tenant's own."""
        if token is None:
            token = os.environ.get("DJINN_TOKEN", "")
        self._native = _native.Client(address, timeout, transport, failover, token)
        self.address = address

    @property
    def mode(self) -> str:
        """"control" (placed by a control plane) or "node" (one node alone)."""
        return self._native.mode

    def register(
        self, model, example_inputs, blocks=None, progress=None, policy=None, phase=None, public=False
    ) -> "RemoteModel":
        return register(
            model,
            example_inputs,
            blocks=blocks,
            progress=progress,
            client=self,
            policy=policy,
            phase=phase,
            public=public,
        )

    def cluster(self) -> dict:
        """The control plane's view: nodes (inventory, lease), models (and who holds them),
        sessions."""
        return json.loads(self._native.cluster())

    def ping(self) -> float:
        """Round-trip time to the node, seconds (a node alone)."""
        return self._native.ping()

    def models(self) -> list[dict]:
        return self._native.list_models()

    def stats(self) -> dict:
        """Transports in use, how the nodes' device memory meets the network (`memory_path`:
        "staging", through host memory), bytes sent and received, request counts, and failover
        counts (placements asked, node failures, re-registrations, replays), and under
        `capture` what transparent capture did in this process (operations recorded, graphs
        built, graph cache hits, graph executions, uploads)."""
        stats = self._native.stats()
        stats["capture"] = capture_stats()
        return stats

    def keep(self, tensor: torch.Tensor, node: Optional[str] = None) -> "RemoteTensor":
        """Uploads `tensor` once to be kept in a node's device memory (`node`, by default the
        node this client was given) and returns it as a RemoteTensor to pass to models there."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"keep takes a tensor, not a {type(tensor).__name__}")
        tensors: list[torch.Tensor] = []
        _flatten(tensor, tensors, [])
        return RemoteTensor(self._native.keep(_spec(tensors[0]), node), self)

    def node_stats(self) -> dict:
        return self._native.node_stats()


_default: Optional[Client] = None
_default_lock = threading.Lock()


def init(
    address: str,
    timeout: float = 60.0,
    transport: str = "auto",
    failover: float = 30.0,
    token: Optional[str] = None,
) -> Client:
    """Connects to a control plane ("http://host:port") or to one node ("host:port") and
    makes it the default. See `Client`."""
    global _default
    client = Client(address, timeout, transport, failover, token)
    with _default_lock:
        _default = client
    return client


def _client(client: Optional[Client]) -> Client:
    if client is not None:
        return client
    if _default is None:
        raise DjinnError("not connected: call djinn.init('host:port') first")
    return _default


def stats() -> dict:
    """The default client's transports, bytes sent and received, request and failover counts."""
    return _client(None).stats()


def status() -> dict:
    """The cluster as the default client's control plane sees it (what `djinn status` prints)."""
    return _client(None).cluster()


class _Callable(nn.Module):
    """Wraps a plain function so that it can be traced into a block."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _as_args(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _to_torchscript(block, args: tuple):
    """TorchScript is what the node's libtorch loads; torch 2.13 marks it deprecated in favour
    of torch.export, which libtorch cannot load, hence the silenced warnings."""
    if isinstance(block, (torch.jit.ScriptModule, torch.jit.ScriptFunction)):
        return block
    module = block if isinstance(block, nn.Module) else _Callable(block)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return torch.jit.script(module)
        except Exception:
            # Not scriptable (Python control flow TorchScript cannot compile): trace it on the
            # inputs it will see. The chained check below catches a trace that does not
            # generalise to these inputs.
            return torch.jit.trace(module, args, strict=False, check_trace=False)


def _archive(script) -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(script, buf)
    return buf.getvalue()


def _mismatch(a, b, path: str = "output") -> Optional[str]:
    """Where `a` (the blocks' output) differs from `b` (the model's), or None."""
    if isinstance(b, torch.Tensor):
        if not isinstance(a, torch.Tensor):
            return f"{path}: a {type(a).__name__} instead of a tensor"
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{path}: {a.dtype}{list(a.shape)} instead of {b.dtype}{list(b.shape)}"
        if a.dtype.is_floating_point:
            ok = torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
        else:
            ok = torch.equal(a, b)
        return None if ok else f"{path}: values differ (largest difference {(a.double() - b.double()).abs().max().item():.3g})"
    if isinstance(b, (tuple, list)):
        if not isinstance(a, (tuple, list)) or len(a) != len(b):
            return f"{path}: {type(a).__name__} of {len(a) if hasattr(a, '__len__') else '?'} instead of {type(b).__name__} of {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            if (m := _mismatch(x, y, f"{path}[{i}]")) is not None:
                return m
        return None
    if isinstance(b, dict):
        if not isinstance(a, dict) or set(a) != set(b):
            return f"{path}: keys {sorted(map(str, a)) if isinstance(a, dict) else type(a).__name__} instead of {sorted(map(str, b))}"
        for k in b:
            if (m := _mismatch(a[k], b[k], f"{path}[{k!r}]")) is not None:
                return m
        return None
    if isinstance(b, float) and isinstance(a, float) and math.isclose(a, b, rel_tol=1e-6):
        return None
    return None if a == b else f"{path}: {a!r} instead of {b!r}"


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    return 0


def _weight_bytes(script) -> int:
    return sum(t.numel() * t.element_size() for t in script.state_dict().values())


_PHASES = ("prefill", "decode")


def register(
    model,
    example_inputs,
    blocks: Optional[Sequence] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    client: Optional[Client] = None,
    policy: Optional[str] = None,
    phase: Optional[str] = None,
    public: bool = False,
) -> "RemoteModel":
    """Turns `model` into TorchScript blocks, uploads them (once per node and tenant) and
    returns a RemoteModel to call. `public` weights are held once per node for every tenant
    that registers the same bytes as public; else the model is the tenant's alone.

    `example_inputs`: one input, or a tuple of positional inputs. `blocks`: submodules or
    callables in execution order whose chained application reproduces `model`; by default an
    `nn.Sequential` is split into its layers and anything else is one block.
    `progress(sent, total)` follows the upload.

    With a control plane, the model is described to it first: each block's weight bytes and
    FLOPs (counted while the blocks run on the example inputs), the bytes of one call's inputs
    and outputs, and `phase` when given ("prefill": compute-bound; "decode": bound by reading
    the weights). `policy` chooses the node: "minimize_latency" (the control plane's default),
    "maximize_throughput", "load_balance" or "minimize_cost"."""
    if phase is not None and phase not in _PHASES:
        raise ValueError(f"phase {phase!r}: one of {', '.join(_PHASES)}, or None")
    client = _client(client)
    args = _as_args(example_inputs)
    if blocks is None:
        blocks = list(model.children()) if isinstance(model, nn.Sequential) and len(model) > 0 else [model]
    if len(blocks) == 0:
        raise ValueError("a model needs at least one block")
    with torch.no_grad():
        was_training = model.training if isinstance(model, nn.Module) else False
        if isinstance(model, nn.Module):
            model.eval()
        try:
            expected = model(*args)
            scripts = []
            estimates = []
            x = args
            for block in blocks:
                script = _to_torchscript(block, x)
                scripts.append(script)
                with FlopCounterMode(display=False) as flops:
                    x = _as_args(script(*x))
                estimates.append((_weight_bytes(script), float(flops.get_total_flops())))
            got = x[0] if len(x) == 1 and not isinstance(expected, tuple) else x
        finally:
            if was_training:
                model.train()
    if (where := _mismatch(got, expected)) is not None:
        raise BlockMismatchError(f"the {len(blocks)} blocks, chained, do not reproduce the model: {where}")
    archives = [_archive(s) for s in scripts]
    description = {"blocks": estimates, "io_bytes": _tensor_bytes(args) + _tensor_bytes(expected), "phase": phase}
    return RemoteModel(client, archives, progress, description, policy, public)


class RemoteModel:
    """A model registered on a node. Calling it runs it there and returns CPU tensors, in the
    structure the local model returns. The client keeps the archives: a node that lost the
    model (a restart, eviction, or a new node after a failover) gets it again by itself."""

    def __init__(
        self, client: Client, archives: list[bytes], progress=None, description=None, policy=None, public=False
    ):
        self._client = client
        # The same bytes objects the client keeps: another client can register them as they are.
        self._archives = archives
        self.fingerprint, self.uploaded, self.weight_bytes = client._native.register_model(
            archives, progress, description, policy, public
        )
        self.blocks = len(archives)
        self.description = description

    def __repr__(self) -> str:
        return f"RemoteModel({self.fingerprint[:16]}…, {self.blocks} blocks, on {self._client.address})"

    @property
    def placement(self) -> Optional[dict]:
        """The control plane's decision for this model (node, address, rule, policy, fit, cost
        by part, runner-up), or None with a node alone."""
        decision = self._client._native.placement(self.fingerprint)
        return None if decision is None else json.loads(decision)

    def __call__(self, *inputs, keep: bool = False):
        """Runs the model on `inputs` (tensors, RemoteTensors, numbers, strings, and tuples,
        lists and dicts of them). RemoteTensor inputs are used where they are kept: the call
        runs on their node (which gets the model if it lacks it). With `keep=True` the output
        tensors stay on the node and come back as RemoteTensors."""
        wire_inputs, specs, at = self._inputs(inputs)
        out = self._client._native.execute(self.fingerprint, wire_inputs, specs, keep, at)
        return _unflatten(out, self._client)

    def run_until(self, block: int, *inputs, keep: bool = False, fetch: bool = True) -> "Paused":
        """Runs blocks 0..`block` of the model on `inputs` (as a call does) and stops there:
        the request waits on the node, with block `block`'s output (the activation) kept in its
        device memory. `fetch=False` leaves the activation there until `.activation` is read.
        See `Paused`."""
        wire_inputs, specs, at = self._inputs(inputs)
        parked, activation = self._client._native.execute_until(
            self.fingerprint, wire_inputs, specs, int(block), fetch, keep, at
        )
        return Paused(self._client, parked, int(block), activation, fetch)

    def _inputs(self, inputs: tuple) -> tuple:
        """The wire form of `inputs`, the specs of their tensors, and the node of their
        RemoteTensors (None when there are none)."""
        tensors: list[torch.Tensor] = []
        nodes: list[str] = []
        wire_inputs = [_flatten(v, tensors, nodes) for v in inputs]
        if len(set(nodes)) > 1:
            raise DjinnError(
                f"the RemoteTensor inputs are on several nodes ({', '.join(sorted(set(nodes)))}): push them to one first"
            )
        return wire_inputs, [_spec(t) for t in tensors], nodes[0] if nodes else None

    def session(self, *state: torch.Tensor, reserve: int = 0) -> "Session":
        """Opens a session of this model on its node, with `state` as its initial state. See
        `Session`."""
        return Session(self, state, reserve)

    def unregister(self) -> None:
        self._client._native.unregister_model(self.fingerprint)


def session(model: RemoteModel, *state: torch.Tensor, reserve: int = 0) -> "Session":
    """Opens a session of `model` on its node, with `state` (tensors: a KV cache, a position)
    as its initial state. See `Session`."""
    return Session(model, state, reserve)


class Session:
    """State that stays in a node's device memory between calls of a model, such as an LLM
    agent's KV cache. Each step runs `model(*inputs, *state)` on the node; the model returns
    `(*outputs, *new_state)`, the new state stays there and the outputs come back (one output
    alone, unwrapped).

        with djinn.session(rm, cache, position) as s:
            logits = s.step(tokens)
            s.io_wait(800)   # the agent waits ~800 ms on a tool: the node moves the state to host memory
            s.compute()      # it is back: the node restores the state (the next step would too)

    Signals and steps take effect on the node in the order sent. `reserve`: device bytes to
    hold for the state as it grows (the node charges the larger of the two). Closing frees the
    state; a session never closed (its client died) is closed by the node after its
    `--session-idle-timeout`. If the node dies, the state is lost with it (HandleLostError)."""

    __slots__ = ("model", "_client", "_native", "_closed")

    def __init__(self, model: RemoteModel, state: Sequence[torch.Tensor], reserve: int = 0):
        tensors: list[torch.Tensor] = []
        for t in state:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"a session's state is tensors, not a {type(t).__name__}")
            _flatten(t, tensors, [])
        self.model = model
        self._client = model._client
        self._closed = True
        self._native = self._client._native.session_open(model.fingerprint, [_spec(t) for t in tensors], reserve)
        self._closed = False

    @property
    def node(self) -> str:
        """The address of the node that holds the session's state."""
        return self._native.node

    def step(self, *inputs):
        """Runs the model on `inputs` and the session's state; returns the outputs."""
        wire_inputs, specs = self._inputs(inputs)
        out = self._client._native.session_step(self._native, wire_inputs, specs)
        return _unflatten(out, self._client)

    def step_until(self, block: int, *inputs, fetch: bool = True) -> "Paused":
        """A step stopped after block `block` (see `Paused`): its activation includes the
        state as the blocks pass it on. Resumed to its end, the step returns its outputs and
        the new state stays on the node; aborted, the state stays as it was. The session's
        later steps and signals wait until then."""
        wire_inputs, specs = self._inputs(inputs)
        parked, activation = self._client._native.session_step_until(
            self._native, wire_inputs, specs, int(block), fetch
        )
        return Paused(self._client, parked, int(block), activation, fetch)

    def _inputs(self, inputs: tuple) -> tuple:
        self._check()
        tensors: list[torch.Tensor] = []
        nodes: list[str] = []
        wire_inputs = [_flatten(v, tensors, nodes) for v in inputs]
        if any(n != self.node for n in nodes):
            raise DjinnError(f"RemoteTensor inputs of a session must be on its node ({self.node})")
        return wire_inputs, [_spec(t) for t in tensors]

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


class Paused:
    """A run of a remote model stopped after block `block`: the request waits on its node,
    holding no worker, with that block's output (the activation) kept in device memory.

        p = rm.run_until(2, x)     # blocks 0, 1, 2 run
        a = p.activation           # block 2's output: a tensor, or a tuple if the block returns several
        y = p.resume()             # blocks 3.. run on the kept activation; y is what rm(x) returns
        y = p.resume(a + delta)    # ... or on a replacement of the same structure, shapes and dtypes
        q = p.resume(until=5)      # ... or stop again after block 5 (a new Paused)
        p.abort()                  # ... or drop it

    A Paused is resumed or aborted once; a resume whose blocks fail (ExecutionError) or whose
    replacement does not match (BreakpointError) leaves it parked, to try again. The node
    releases a request parked longer than its `--parked-ttl`, and one dropped here unresumed
    is aborted with the client's next call."""

    __slots__ = ("block", "_client", "_native", "_activation", "_fetched", "_done")

    def __init__(self, client: Client, native, block: int, activation, fetched: bool):
        self.block = block
        self._client = client
        self._native = native
        self._activation = _unflatten(activation, client) if fetched else None
        self._fetched = fetched
        self._done = False

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
            self._activation = _unflatten(self._client._native.inspect(self._native), self._client)
            self._fetched = True
        return self._activation

    def resume(self, activation=None, until: Optional[int] = None, fetch: bool = True):
        """Runs the remaining blocks, on the kept activation or on `activation`, and returns
        the model's output; with `until`, stops again after that block and returns a new
        Paused (`fetch` as for `run_until`)."""
        self._check()
        tensors: list[torch.Tensor] = []
        nodes: list[str] = []
        wire = None if activation is None else _flatten(activation, tensors, nodes)
        if nodes:
            raise DjinnError("a replacement activation is made of tensors sent with the resume, not RemoteTensors")
        try:
            parked, out = self._client._native.resume(
                self._native, wire, [_spec(t) for t in tensors], None if until is None else int(until), fetch
            )
        except (NotFoundError, StaleHandleError, HandleLostError):
            self._done = True
            raise
        self._done = True
        if parked is None:
            return _unflatten(out, self._client)
        return Paused(self._client, parked, int(until), out, fetch)

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


def _spec(t: torch.Tensor) -> tuple:
    """What the native client sends a tensor from: dtype, shape, data pointer, byte length."""
    return (_WIRE_DTYPES[t.dtype], list(t.shape), t.data_ptr(), t.numel() * t.element_size())


class RemoteTensor:
    """A tensor kept in a node's device memory: the output of `rm(..., keep=True)`,
    `client.keep(t)` or `t.push(node)`. Passed to a model on its node, it does not cross the
    network. `.cpu()` brings its bytes back. It is freed when released or garbage-collected,
    or by the node after its `--handle-ttl` unused. If its node dies or restarts, it is gone:
    using it raises HandleLostError or StaleHandleError."""

    __slots__ = ("_kept", "_client", "_released", "path")

    def __init__(self, kept, client: Client, path: Optional[str] = None):
        self._kept = kept
        self._client = client
        self._released = False
        # How the bytes got here, for a pushed tensor ("staging-tcp").
        self.path = path

    @property
    def node(self) -> str:
        """The address of the node that holds it."""
        return self._kept.node

    @property
    def dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self._kept.dtype]

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._kept.shape)

    @property
    def nbytes(self) -> int:
        return self._kept.nbytes

    def cpu(self) -> torch.Tensor:
        """Fetches the tensor's bytes from its node."""
        self._check()
        fetched = self._client._native.fetch(self._kept)
        if self.nbytes == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(fetched, dtype=self.dtype).view(self.shape)

    def push(self, node: str) -> "RemoteTensor":
        """Has its node copy it into the device memory of the node at `node` ("HOST:PORT"),
        node to node; returns the copy there (this one stays)."""
        self._check()
        kept, path = self._client._native.push(self._kept, node)
        return RemoteTensor(kept, self._client, path)

    def release(self) -> None:
        """Frees it on its node now."""
        if not self._released:
            self._released = True
            self._client._native.release([self._kept])

    def _check(self) -> None:
        if self._released:
            raise DjinnError(f"{self!r} was released")

    def __del__(self):
        if not getattr(self, "_released", True):
            try:
                self._client._native.release_later(self._kept)
            except Exception:  # interpreter shutdown: the node's --handle-ttl frees it
                pass

    def __repr__(self) -> str:
        return f"RemoteTensor({self.dtype}{list(self.shape)} on {self.node}, handle {self._kept.id})"


def _flatten(value, tensors: list, nodes: list):
    if isinstance(value, RemoteTensor):
        value._check()
        nodes.append(value.node)
        return value._kept
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.dtype not in _WIRE_DTYPES:
            raise TypeError(f"tensors of {t.dtype} cannot be sent (supported: {', '.join(map(str, _WIRE_DTYPES))})")
        if t.device.type != "cpu":
            t = t.cpu()
        tensors.append(t.contiguous())
        return _native.TensorSlot(len(tensors) - 1)
    if isinstance(value, tuple):
        return tuple(_flatten(v, tensors, nodes) for v in value)
    if isinstance(value, list):
        return [_flatten(v, tensors, nodes) for v in value]
    if isinstance(value, dict):
        return {k: _flatten(v, tensors, nodes) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot send a {type(value).__name__} to a remote model")


def _unflatten(value, client: Client):
    if isinstance(value, _native.Kept):
        return RemoteTensor(value, client)
    if isinstance(value, _native.OutputTensor):
        dtype = _TORCH_DTYPES[value.dtype]
        shape = tuple(value.shape)
        if value.nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(value, dtype=dtype).view(shape)
    if isinstance(value, tuple):
        return tuple(_unflatten(v, client) for v in value)
    if isinstance(value, list):
        return [_unflatten(v, client) for v in value]
    if isinstance(value, dict):
        return {k: _unflatten(v, client) for k, v in value.items()}
    return value


class _LazyRemote:
    def __init__(self, model, client):
        self._model = model
        self._client = client
        self._remote: Optional[RemoteModel] = None
        self._lock = threading.Lock()

    def __call__(self, *inputs):
        if self._remote is None:
            with self._lock:
                if self._remote is None:
                    self._remote = register(self._model, inputs, client=self._client)
        return self._remote(*inputs)


def remote(model, client: Optional[Client] = None) -> Callable:
    """A callable that registers `model` on its first call (with that call's inputs as the
    example) and runs it remotely from then on."""
    return _LazyRemote(model, client)


from .capture import LazyTensor, UnsupportedOperationError, capture, get_graph  # noqa: E402
from .capture import _copy_stats as capture_stats  # noqa: E402
