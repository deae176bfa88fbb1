"""Models on nodes: a model exported as a graph (by default) or split into TorchScript blocks,
registered once, then run by fingerprint (`RemoteModel`)."""

from __future__ import annotations

import io
import json
import math
import warnings
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from . import graphs
from ._wire import CallTensors, unflatten
from .breakpoints import Paused
from .errors import BlockMismatchError
from .sessions import Session

if TYPE_CHECKING:
    from .client import Client


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


def register_with(
    client: Client,
    model,
    example_inputs,
    blocks: Optional[Sequence] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    policy: Optional[str] = None,
    phase: Optional[str] = None,
    public: bool = False,
    dynamic: Optional[dict] = None,
    split=None,
    cache_len: Optional[int] = None,
) -> RemoteModel:
    """`djinn.register` on `client`: see there."""
    if phase is not None and phase not in _PHASES:
        raise ValueError(f"phase {phase!r}: one of {', '.join(_PHASES)}, or None")
    if blocks is None and isinstance(model, nn.Module) and not isinstance(model, torch.jit.ScriptModule):
        graph_options = (dynamic, split, cache_len)
        return _register_graph(client, model, example_inputs, graph_options, progress, policy, phase, public)
    if dynamic is not None or split is not None or cache_len is not None:
        raise ValueError("dynamic=, split= and cache_len= are for models registered as graphs (without blocks=)")
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


def _register_graph(client, model, example_inputs, options, progress, policy, phase, public) -> "RemoteModel":
    """The model as a graph, exported with torch.export, checked and run by the node; cut into
    blocks at submodules with `split`; with a static KV cache of `cache_len` positions as a
    session's state, a prefill graph on the example and a decode graph of one token."""
    dynamic, split, cache_len = options
    if isinstance(example_inputs, dict):
        args, kwargs = (), example_inputs
    else:
        args, kwargs = _as_args(example_inputs), {}
    if cache_len is None:
        graph = graphs.export(model, args, kwargs, dynamic, split)
    else:
        from .cache import StaticCacheLM

        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or len(args) + len(kwargs) != 1:
            raise ValueError("cache_len= takes one example input, input_ids, of shape [batch, sequence]")
        if split is not None:
            raise ValueError("split= with cache_len=: a model that keeps a cache is one block")
        step = StaticCacheLM(model, ids.shape[0], int(cache_len))
        decode = [{"input_ids": ids[:, :1]}] if ids.shape[1] > 1 else []
        graph = graphs.export(step, (), {"input_ids": ids}, dynamic, None, entries=decode)
        args, kwargs = (), {"input_ids": ids}
    with torch.no_grad(), FlopCounterMode(display=False) as flops:
        expected = model(*args, **kwargs)
    # The placement's estimate: each block's share of the FLOPs in proportion to its weights.
    sizes = [len(c) for c in graph.containers]
    total = float(flops.get_total_flops())
    estimates = [(n, total * n / max(sum(sizes), 1)) for n in sizes]
    io_bytes = _tensor_bytes(args) + _tensor_bytes(kwargs) + _tensor_bytes(expected)
    description = {"blocks": estimates, "io_bytes": io_bytes, "phase": phase}
    return RemoteModel(client, graph.containers, progress, description, policy, public, graph=graph)


class RemoteModel:
    """A model registered on a node. Calling it runs it there and returns CPU tensors, in the
    structure the local model returns. The client keeps the archives: a node that lost the
    model (a restart, eviction, or a new node after a failover) gets it again by itself."""

    __module__ = "djinn"

    def __init__(
        self,
        client: Client,
        archives: list[bytes],
        progress=None,
        description=None,
        policy=None,
        public=False,
        graph: Optional[graphs.Graph] = None,
    ):
        self._client = client
        # Set for a model registered as a graph: how calls bind to its inputs and outputs.
        self._graph = graph
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

    def __call__(self, *inputs, keep: bool = False, **kwargs):
        """Runs the model on `inputs` (tensors, RemoteTensors, numbers, strings, and tuples,
        lists and dicts of them; a graph takes its inputs as the model's forward does,
        keywords too). RemoteTensor inputs are used where they are kept: the call runs on
        their node (which gets the model if it lacks it). With `keep=True` the output tensors
        stay on the node and come back as RemoteTensors. A graph's output comes back in the
        model's structure (a Hugging Face ModelOutput as that dataclass)."""
        if self._graph is not None:
            if self._graph.state:
                raise TypeError("the model keeps a cache between calls: run it in a session (rm.session())")
            inputs = tuple(self._graph.call_tensors(inputs, kwargs))
        elif kwargs:
            raise TypeError("keyword inputs are for models registered as graphs")
        wire, call = self._inputs(inputs)
        out = unflatten(self._client._native.execute(self.fingerprint, wire, call.tensors, keep, call.node()), self._client)
        if self._graph is None:
            return out
        return self._graph.outputs(list(out) if isinstance(out, tuple) else [out])

    def run_until(self, block: int, *inputs, keep: bool = False, fetch: bool = True, **kwargs) -> "Paused":
        """Runs blocks 0..`block` of the model on `inputs` (as a call does) and stops there:
        the request waits on the node, with block `block`'s output (the activation) kept in its
        device memory; a graph's is a dict of what the block passes on, by name (see
        `djinn.register`'s `split`). `fetch=False` leaves the activation there until
        `.activation` is read. See `Paused`."""
        if self._graph is not None:
            inputs = tuple(self._graph.call_tensors(inputs, kwargs))
        elif kwargs:
            raise TypeError("keyword inputs are for models registered as graphs")
        wire, call = self._inputs(inputs)
        parked, activation = self._client._native.execute_until(
            self.fingerprint, wire, call.tensors, int(block), fetch, keep, call.node()
        )
        return Paused(self._client, parked, int(block), activation, fetch, self._graph)

    def _inputs(self, inputs: tuple) -> tuple[list, CallTensors]:
        """The wire form of `inputs` and the tensors they send."""
        call = CallTensors()
        return [call.flatten(v) for v in inputs], call

    def session(self, *state: torch.Tensor, reserve: int = 0) -> "Session":
        """Opens a session of this model on its node, with `state` as its initial state (a
        graph's: the state it was registered with, unless given). See `Session`."""
        if self._graph is not None and not self._graph.state:
            raise TypeError("the model keeps no state: register it with cache_len= (or write its buffers in forward)")
        return Session(self, state, reserve)

    def unregister(self) -> None:
        self._client._native.unregister_model(self.fingerprint)
