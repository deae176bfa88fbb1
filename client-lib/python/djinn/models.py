"""Models on nodes: a model exported as a graph, whole or in blocks (or TorchScript a trusted
user scripted), registered once, then run by fingerprint (`RemoteModel`)."""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import re
import math
import warnings
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from . import graphs
from ._wire import CallTensors, unflatten
from .breakpoints import Paused
from .errors import BlockMismatchError, GraphRefusedError
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


@contextlib.contextmanager
def _evaluating(model):
    """`model` in eval mode, each of its modules' own mode put back after."""
    modes = [(m, m.training) for m in model.modules()] if isinstance(model, nn.Module) else []
    try:
        if isinstance(model, nn.Module):
            model.eval()
        yield
    finally:
        for m, training in modes:
            m.training = training


def _is_script(block) -> bool:
    return isinstance(block, (torch.jit.ScriptModule, torch.jit.ScriptFunction))


class _Chain(nn.Module):
    """`blocks` run one after another, as `blocks=` promises they reproduce the model: block 0
    takes the call's inputs, each later block the output of the one before (spread over its
    arguments when a tuple). Its forward has the model's signature, so that the example and
    `dynamic` name inputs as the model's forward does."""

    def __init__(self, blocks: Sequence, signature: inspect.Signature):
        super().__init__()
        self.blocks = nn.ModuleList(b if isinstance(b, nn.Module) else _Callable(b) for b in blocks)
        names = list(signature.parameters)

        def forward(*args, **kwargs):
            x = (*args, *(kwargs[n] for n in names[len(args):] if n in kwargs))
            for block in self.blocks:
                x = _as_args(block(*x))
            return x[0] if len(x) == 1 else x

        forward.__signature__ = signature
        self.forward = forward


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


def _weight_bytes(block) -> int:
    """The bytes of a block's weights (none for a function)."""
    state = block.state_dict() if hasattr(block, "state_dict") else {}
    return sum(t.numel() * t.element_size() for t in state.values())


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
    scripted = [b for b in (blocks if blocks is not None else [model]) if _is_script(b)]
    if not scripted:
        if blocks is None and isinstance(model, nn.Module):
            return _register_graph(client, model, example_inputs, (dynamic, split, cache_len), progress, policy, phase,
                                   public)
        if not callable(model):
            raise TypeError(f"register takes a torch.nn.Module or a function, not a {type(model).__name__}")
        if split is not None or cache_len is not None:
            raise ValueError("split= and cache_len= are for a module registered whole (not with blocks= or a function)")
        # A function is one block.
        return _register_blocks(client, model, example_inputs, blocks or [model], dynamic, progress, policy, phase,
                                public)
    # TorchScript the user scripted: code that runs on the node, for principals with the right.
    if dynamic is not None or split is not None or cache_len is not None:
        raise ValueError("dynamic=, split= and cache_len= are for models registered as graphs, not TorchScript")
    if blocks is None:
        blocks = [model]
    if len(scripted) != len(blocks):
        raise ValueError("blocks= mixes TorchScript and modules: script every block, or none (they are sent as graphs)")
    if len(blocks) == 0:
        raise ValueError("a model needs at least one block")
    args = _as_args(example_inputs)
    with torch.no_grad(), _evaluating(model):
        expected = model(*args)
        estimates = []
        x = args
        for script in blocks:
            with FlopCounterMode(display=False) as flops:
                x = _as_args(script(*x))
            estimates.append((_weight_bytes(script), float(flops.get_total_flops())))
        got = x[0] if len(x) == 1 and not isinstance(expected, tuple) else x
    if (where := _mismatch(got, expected)) is not None:
        raise BlockMismatchError(f"the {len(blocks)} blocks, chained, do not reproduce the model: {where}")
    archives = [_archive(s) for s in blocks]
    description = {"blocks": estimates, "io_bytes": _tensor_bytes(args) + _tensor_bytes(expected), "phase": phase}
    return RemoteModel(client, archives, progress, description, policy, public)


def _register_blocks(client, model, example_inputs, blocks, dynamic, progress, policy, phase, public) -> "RemoteModel":
    """`blocks=`: the blocks chained, exported as one graph cut after each block but the last.
    What block k hands on (its output) is named as the block is in the model (`layers.3`), or
    `block3` for one that is not a submodule of it."""
    if len(blocks) == 0:
        raise ValueError("a model needs at least one block")
    forward = model.forward if isinstance(model, nn.Module) else model
    chain = _Chain(blocks, inspect.signature(forward))
    args, kwargs = (((), example_inputs) if isinstance(example_inputs, dict) else (_as_args(example_inputs), {}))
    # Each block's weight bytes and FLOPs on its inputs, for the placement's estimate.
    flops = []
    with torch.no_grad(), _evaluating(model):
        expected = model(*args, **kwargs)
        x = (*args, *kwargs.values())
        for block in chain.blocks:
            with FlopCounterMode(display=False) as counter:
                x = _as_args(block(*x))
            flops.append((_weight_bytes(block), float(counter.get_total_flops())))
        got = x[0] if len(x) == 1 else x
    if (where := _mismatch(got, expected)) is not None:
        raise BlockMismatchError(f"the {len(blocks)} blocks, chained, do not reproduce the model: {where}")
    names = {id(m): n for n, m in model.named_modules() if n} if isinstance(model, nn.Module) else {}
    own = [names.get(id(b), f"block{k}") for k, b in enumerate(blocks)]

    def rename(name: str) -> str:
        return re.sub(r"^blocks\.(\d+)", lambda m: own[int(m.group(1))], name)

    cuts = [f"blocks.{k}" for k in range(len(blocks) - 1)] or None
    return _register_graph(client, chain, example_inputs, (dynamic, cuts, None), progress, policy, phase, public,
                           rename, flops)


def _register_graph(client, model, example_inputs, options, progress, policy, phase, public,
                    rename=None, estimates=None) -> "RemoteModel":
    """The model as a graph, exported with torch.export, checked and run by the node; cut into
    blocks at submodules with `split`; with a static KV cache of `cache_len` positions as a
    session's state, a prefill graph on the example and a decode graph of one token."""
    dynamic, split, cache_len = options
    if isinstance(example_inputs, dict):
        args, kwargs = (), example_inputs
    else:
        args, kwargs = _as_args(example_inputs), {}
    def without_cache():
        return _without_returned_cache(model, kwargs) if cache_len is None else contextlib.nullcontext()

    if cache_len is None:
        with without_cache():
            graph = graphs.export(model, args, kwargs, dynamic, split)
        if rename is not None:
            graph.cuts = [[rename(n) for n in names] for names in graph.cuts]
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
    with torch.no_grad(), without_cache(), FlopCounterMode(display=False) as flops:
        expected = model(*args, **kwargs)
    if estimates is None:
        # The placement's estimate: each block's share of the FLOPs in proportion to its weights.
        sizes = [len(c) for c in graph.containers]
        total = float(flops.get_total_flops())
        estimates = [(n, total * n / max(sum(sizes), 1)) for n in sizes]
    io_bytes = _tensor_bytes(args) + _tensor_bytes(kwargs) + _tensor_bytes(expected)
    description = {"blocks": estimates, "io_bytes": io_bytes, "phase": phase}
    return RemoteModel(client, graph.containers, progress, description, policy, public, graph=graph)


def _refusal_in_the_models_terms(e: GraphRefusedError, graph: Optional[graphs.Graph]) -> GraphRefusedError:
    """The node's refusal of an operator, with the module of the model that calls it and what
    to do instead (the node's message first)."""
    named = re.search(r"(aten::\w+)", str(e))
    module = graph.op_modules.get(named[1]) if graph is not None and named else None
    if module is None:
        return e
    return GraphRefusedError(
        f"{e}\n{named[1]} comes from {module}: run that part on the client (a wrapper that registers the rest and "
        f"takes its result as an input), cut the model around it with split=, or replace it with operators the "
        f"node runs (its allowlist: docs/graph-format.md)"
    )


_CACHE_LEFT_OUT_WARNED = False


@contextlib.contextmanager
def _without_returned_cache(model, kwargs: dict):
    """A Hugging Face model that returns its KV cache by default (`config.use_cache`, every
    causal LM's default) is exported without it: graphs return tensors, and a cache belongs on
    the node, in a session (`cache_len=`). Warns once per process that `past_key_values` is
    left out. A model whose example passes `use_cache` itself is left as it is."""
    global _CACHE_LEFT_OUT_WARNED
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False) or "use_cache" in kwargs:
        yield
        return
    if not _CACHE_LEFT_OUT_WARNED:
        _CACHE_LEFT_OUT_WARNED = True
        warnings.warn(
            f"{type(model).__name__} returns its KV cache (config.use_cache): djinn registers it without one, "
            "so calls return the logits and no past_key_values. To decode token by token with the cache kept on "
            "the node, register with cache_len=N and call rm.session().",
        )
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = True


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
        try:
            self.fingerprint, self.uploaded, self.weight_bytes = client._native.register_model(
                archives, progress, description, policy, public
            )
        except GraphRefusedError as e:
            raise _refusal_in_the_models_terms(e, graph) from e
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

    def session(
        self,
        *state: torch.Tensor,
        reserve: int = 0,
        key: Optional[str] = None,
        prefill: Optional[str] = None,
        decode: Optional[str] = None,
        decode_steps: int = 64,
    ) -> "Session":
        """Opens a session of this model on its node, with `state` as its initial state (a
        graph's: the state it was registered with, unless given). See `Session`."""
        if self._graph is not None and not self._graph.state:
            raise TypeError("the model keeps no state: register it with cache_len= (or write its buffers in forward)")
        return Session(self, state, reserve, key, prefill, decode, decode_steps)

    def unregister(self) -> None:
        self._client._native.unregister_model(self.fingerprint)
