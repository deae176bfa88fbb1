"""Transparent capture: tensors on `remote_accelerator:N` record aten operations instead of
running them, and reading one (`.cpu()`, `.item()`, printing, comparing with a local tensor)
runs the recorded graph on node N.

    model.to("remote_accelerator:0")            # the weights are uploaded once, kept on the node
    y = model(x)                                 # recorded: a LazyTensor, nothing has run
    y.cpu()                                      # the graph that makes y runs on the node

How it works, in order:
- `remote_accelerator` is PyTorch's PrivateUse1 backend, renamed. Factory functions with that
  device reach kernels registered here for it; every other operation on a LazyTensor reaches
  `LazyTensor.__torch_dispatch__`, below autograd, as an aten operation.
- Each operation runs on the meta device to learn its outputs' shapes, dtypes and strides (no
  data; once per operation and argument signature), and is recorded: its function, its
  arguments with values in place of tensors, and the storage it writes. Views share their base's storage; an in-place operation is appended to
  its storage's writes. A local tensor operand is copied (as it is now) and becomes an input.
- Reading a tensor gathers the operations it depends on (their inputs', recursively, and every
  write to a storage they read), in recording order, and writes them out as a graph
  (`djinn.graphs`' format: each aten call by its schema name, the inputs read-only, an in-place
  call other than the few the allowlist has written as its functional form and a `copy_`,
  random calls in the overloads that take the node's per-request generator, `empty*` as
  zeros). A size in a `SymInt` or `Scalar` argument is read from the first tensor of the graph
  that has it, so calls that differ only in sizes write one graph. The node checks and runs
  it as any tenant's graph; no TorchScript is involved. A graph seen before is a dictionary
  look-up away from its fingerprint on the node; a new one is registered once.
- A read also runs every other pending tensor Python holds and keeps it on the node: what a
  graph computed is never history that a later graph runs again.
- Copying a local tensor into a fresh remote one (`.to("remote_accelerator:0")`, which is what
  `module.to` does to each weight) uploads it at once; it stays on the node and graphs take it
  by handle. Random operations run at once too and their result is kept on the node, so that
  every later read sees the same numbers.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
import weakref
from typing import Optional

import torch

from . import _stats, graphs
from ._recording import _DEVICE, _DeviceArg, _contiguous, _layout, _meta_args_of, _Op, _span, _Storage, _Value, _walk
from ._wire import CallTensors, unflatten
from .client import _client
from .errors import DjinnError, UnsupportedOperationError
from .models import RemoteModel
from .tensors import RemoteTensor
from .srg import SemanticGraph, annotate

DEVICE_TYPE = "remote_accelerator"

aten = torch.ops.aten


_lock = threading.RLock()
_seq = itertools.count()
# Storages with recorded work not yet run (made or written since they were last computed): a
# read runs all of them that live tensors view, and keeps those on the node, so that nothing
# computed once is recorded history that a later graph would run again.
_pending: weakref.WeakSet = weakref.WeakSet()
_counters = _stats.capture
_last_graph: Optional[SemanticGraph] = None
# A storage written this many times is computed and kept on the node, so that graphs stay short
# however often a buffer is updated in place.
_MAX_WRITES = 64

# Results that are read from the data, not computed: the graph that makes their operands runs
# on the node, then these run on the fetched values.
_READS = {
    aten._local_scalar_dense.default,
    aten.equal.default,
    aten.is_nonzero.default,
    aten.allclose.default,
}
_EMPTY = {aten.empty, aten.empty_strided}
_RANDOM_WORDS = ("rand", "normal", "bernoulli", "dropout", "uniform", "exponential", "cauchy", "geometric",
                 "multinomial", "poisson", "rrelu", "random", "binomial", "gamma", "dirichlet")


def _is_random(func) -> bool:
    """Draws random numbers. (PyTorch also tags attention kernels that take a dropout
    probability as seeded; recomputed, they give the same result.)"""
    name = func.overloadpacket.__name__
    return torch.Tag.nondeterministic_seeded in func.tags and any(w in name for w in _RANDOM_WORDS)


# ---------------------------------------------------------------------------------------------
# The tensor


class LazyTensor(torch.Tensor):
    """A tensor on `remote_accelerator:N`: its value is the recorded graph that makes it.
    Reading it (`.cpu()`, `.item()`, `.tolist()`, `.numpy()`, printing, comparing it with a
    local tensor) runs that graph on node N."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, value: _Value):
        shape, stride, offset, dtype = value.layout
        index = value.storage.index
        device = _devices.get(index) or _devices.setdefault(index, torch.device(DEVICE_TYPE, index))
        t = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=stride, storage_offset=offset, dtype=dtype, device=device, requires_grad=False
        )
        t._value = value
        value.storage.tensors.add(t)
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        with _lock:
            return _dispatch(func, args, kwargs or {})

    def __repr__(self, *, tensor_contents=None) -> str:
        text = repr(self.cpu().detach())
        return f"{text[:-1]}, device='{self.device}')"

    def tolist(self):
        return self.cpu().tolist()

    def numpy(self, *, force: bool = False):
        return self.cpu().detach().numpy()


_devices: dict[int, torch.device] = {}


def _leaves(value, out: list) -> list:
    if isinstance(value, (list, tuple)):
        for v in value:
            _leaves(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _leaves(v, out)
    else:
        out.append(value)
    return out


def _is_remote(device) -> bool:
    return device is not None and torch.device(device).type == DEVICE_TYPE


# ---------------------------------------------------------------------------------------------
# Recording


# Operations whose result is their operand as it is: the same value, no operation recorded.
_SAME = {aten.detach.default, aten.alias.default}


def _dispatch(func, args: tuple, kwargs: dict):
    if func in _SAME and isinstance(args[0], LazyTensor):
        return LazyTensor(args[0]._value)
    if func is aten.scaled_dot_product_attention.default:
        given = dict(zip(("attn_mask", "dropout_p", "is_causal"), args[3:]), **kwargs)
        if given.get("dropout_p", 0.0):
            # Dropout draws random numbers, which recording keeps as drawn: PyTorch's own
            # decomposition, recorded operation by operation.
            q, k, v = args[:3]
            return aten._scaled_dot_product_attention_math.default(q, k, v, **given)[0]
    if func in _READS:
        return func(*_read(args), **_read(kwargs))
    if func is aten._to_copy.default and not _is_remote(kwargs.get("device", DEVICE_TYPE)):
        (source,) = _read(args[:1])
        return aten._to_copy.default(source, **kwargs)
    if func is aten.copy_.default:
        dest, source = args[0], args[1]
        if not isinstance(dest, LazyTensor):
            return dest.copy_(*_read((source,)), *args[2:])
        if not isinstance(source, LazyTensor) and _upload(dest, source):
            return dest
    return _record(func, args, kwargs)


def _read(values):
    """`values` with every LazyTensor replaced by its data, computed on its node."""
    lazies = [v for v in _leaves(values, []) if isinstance(v, LazyTensor)]
    data = dict(zip(map(id, lazies), _materialize(lazies))) if lazies else {}
    return _walk(values, lambda v: data[id(v)] if isinstance(v, LazyTensor) else v)


def _local_leaf(t: torch.Tensor, index: int) -> _Value:
    """A local operand as it is now: a contiguous CPU copy, sent with the graph."""
    data = t.detach().to("cpu", copy=True).contiguous()
    return _Value(None, (), _contiguous(data.shape, data.dtype), _Storage(index), data)


def _declared_types(schema) -> list[str]:
    """The declared type of each argument of `schema` (`SymInt[]`, `Tensor(a!)`, ...), which
    its Python binding does not tell apart from `int`."""
    text = str(schema)
    body = text[text.index("(") + 1 : text.rindex(") ->")]
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(body):
        depth += ch in "([" and 1 or ch in ")]" and -1 or 0
        if ch == "," and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return [p.split()[0] for p in map(str.strip, parts) if p and p != "*"]


class _Info:
    """What recording needs of an operation's schema, worked out once per operation."""

    __slots__ = ("schema", "writes", "returns", "random", "sizes", "is_size", "name", "overload", "n_returns",
                 "composite")

    def __init__(self, func):
        schema = func._schema
        self.schema = schema
        # A composite operator that reaches recording (called from within another's
        # decomposition, below autograd, where PyTorch does not decompose it): decomposed here.
        self.composite = func not in _WHOLE and torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), "CompositeImplicitAutograd"
        )
        self.name, self.n_returns = schema.name, len(schema.returns)
        self.overload = graphs._WITH_GENERATOR.get((schema.name, schema.overload_name), schema.overload_name)
        # The arguments that may hold sizes (`SymInt`, and `Scalar`s: arange's bounds, a
        # count compared with a length): a graph reads an integer in them from its tensors'
        # sizes where one has it, so that it serves every call whose sizes differ.
        names = [a.name for a in schema.arguments]
        self.sizes = frozenset(n for n, t in zip(names, _declared_types(schema)) if t.startswith(("SymInt", "Scalar")))
        self.is_size = [n in self.sizes for n in names]
        # The arguments it writes into: (position, name).
        self.writes = [
            (i, a.name) for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        ]
        # Per return: None, or (writes, position, name) of the argument it aliases.
        self.returns = []
        for r in schema.returns:
            source = None
            if r.alias_info is not None:
                for i, a in enumerate(schema.arguments):
                    if a.alias_info is not None and a.alias_info.before_set & r.alias_info.before_set:
                        source = (r.alias_info.is_write, i, a.name)
                        break
            self.returns.append(source)
        self.random = _is_random(func)

    def argument(self, args, kwargs, position: int, name: str):
        return args[position] if position < len(args) else kwargs.get(name)


_infos: dict = {}
# (operation, its arguments' signature) -> the layouts of its outputs: shape inference is done
# once per distinct call.
_calls: dict = {}
_MAX_CALLS = 1 << 16
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
# Arguments that are constants, hashable as they are.
_PLAIN = {int, float, bool, str, type(None), torch.dtype, torch.memory_format, torch.layout}


def _convert(v, inputs: list, others: list) -> tuple:
    """`v`, an argument of an operation, as the recording holds it (values for LazyTensors and
    local tensors), and its signature: what shape inference depends on. The values it reads
    go to `inputs`; local tensors' values and remote devices' indices to `others`."""
    t = type(v)
    if t is LazyTensor:
        value = v._value
        inputs.append(value)
        return value, value.layout
    if t in _PLAIN:
        return v, (t, v)
    if t is list or t is tuple:
        if all(type(x) is int for x in v):
            return v, (t, *v)
        pairs = [_convert(x, inputs, others) for x in v]
        return t(p[0] for p in pairs), (t, *(p[1] for p in pairs))
    if isinstance(v, torch.Tensor):
        value = _local_leaf(v, -1)
        inputs.append(value)
        others.append(value)
        return value, value.layout
    if isinstance(v, torch.device):
        if not _is_remote(v):
            raise UnsupportedOperationError(f"a device argument {v} in a remote graph")
        others.append(v.index or 0)
        return _DEVICE, (_DeviceArg, v.index or 0)
    if isinstance(v, torch.Generator):
        raise UnsupportedOperationError("an explicit generator in a remote graph")
    if isinstance(v, complex):
        raise UnsupportedOperationError("complex numbers in a remote graph")
    if isinstance(v, (list, tuple)):
        return _convert(list(v) if isinstance(v, list) else tuple(v), inputs, others)
    return v, (t, v)


def _index_of(inputs: list, others: list) -> int:
    """The one remote device the operands are on (as eager PyTorch refuses mixed devices)."""
    index = -1
    for i in [v.storage.index for v in inputs] + [o for o in others if type(o) is int]:
        if i >= 0 and i != index:
            if index >= 0:
                raise DjinnError(f"operands on several remote devices ({DEVICE_TYPE}:{index} and {DEVICE_TYPE}:{i})")
            index = i
    return max(index, 0)


def _describe(out):
    """The layouts of what a meta kernel returned (other results as they are)."""
    if isinstance(out, torch.Tensor):
        return _layout(out)
    if isinstance(out, (list, tuple)):
        return type(out)(_describe(x) for x in out)
    return out


def _is_layout(x) -> bool:
    return type(x) is tuple and len(x) == 4 and type(x[3]) is torch.dtype


def _record(func, args: tuple, kwargs: dict):
    info = _infos.get(func) or _info(func)
    if info.composite:
        # PyTorch's own C++ decomposition, as eager PyTorch runs it above autograd.
        return func._op_dk(_COMPOSITE, *args, **kwargs)
    inputs: list = []
    others: list = []
    try:
        rec_args, sig_args = _convert(args, inputs, others)
        rec_kwargs, sig_kwargs = {}, ()
        if kwargs:
            converted = {k: _convert(v, inputs, others) for k, v in kwargs.items()}
            rec_kwargs = {k: c for k, (c, _) in converted.items()}
            sig_kwargs = tuple((k, g) for k, (_, g) in converted.items())
    except UnsupportedOperationError as e:
        raise UnsupportedOperationError(f"{func}: {e}") from None
    index = _index_of(inputs, others)
    for o in others:
        if type(o) is _Value:
            o.storage.index = index
    written = []
    for position, name in info.writes:
        target = info.argument(args, kwargs, position, name)
        if isinstance(target, torch.Tensor) and not isinstance(target, LazyTensor):
            raise UnsupportedOperationError(
                f"{func} writes into a local tensor with remote operands: move it to {DEVICE_TYPE}:{index} first"
            )
        written += [v for v in _leaves(info.argument(rec_args, rec_kwargs, position, name), []) if type(v) is _Value]

    key = (func, sig_args, sig_kwargs)
    out = _calls.get(key)
    if out is None:
        out = _describe(_infer(func, rec_args, rec_kwargs, written))
        if len(_calls) >= _MAX_CALLS:
            _calls.clear()
        _calls[key] = out

    op = _Op(next(_seq), func, rec_args, rec_kwargs, inputs, out)
    for w in written:
        w.storage.writes.append(op)
        _pending.add(w.storage)
    _counters["ops_captured"] += 1

    created: list[_Storage] = []

    def wrap(layout, path, source):
        if not _is_layout(layout):
            return layout
        if source is not None:
            writes, position, name = source
            aliased = info.argument(args, kwargs, position, name)
            if type(aliased) is LazyTensor:
                return aliased if writes else LazyTensor(_Value(op, path, layout, aliased._value.storage))
        storage = _Storage(index)
        created.append(storage)
        _pending.add(storage)
        return LazyTensor(_Value(op, path, layout, storage))

    returns = info.returns
    if not returns:
        result = out
    elif _is_layout(out):
        result = wrap(out, (), returns[0])
    elif len(returns) == 1:
        result = type(out)(wrap(m, (i,), returns[0]) for i, m in enumerate(out))
    else:
        result = tuple(
            type(m)(wrap(x, (i, j), r) for j, x in enumerate(m)) if isinstance(m, list) else wrap(m, (i,), r)
            for i, (m, r) in enumerate(zip(out, returns))
        )

    if info.random:
        for storage in {id(x): x for x in [w.storage for w in written] + created}.values():
            _keep_on_node(storage)
    else:
        for w in written:
            if len(w.storage.writes) > _MAX_WRITES:
                _keep_on_node(w.storage)
    return result


def _infer(func, rec_args, rec_kwargs, written: list):
    """The operation run on the meta device: its outputs' shapes, strides and dtypes."""
    meta_args, meta_kwargs = _meta_args_of(rec_args, rec_kwargs)
    try:
        out = func(*meta_args, **meta_kwargs)
    except Exception as e:  # noqa: BLE001 - whatever the meta kernel raised, named and typed
        raise UnsupportedOperationError(f"{func} cannot be captured: {str(e).splitlines()[0]}") from e
    for w in written:
        if _layout(w.meta) != w.layout:
            w._meta = None
            raise UnsupportedOperationError(f"{func} changes the shape of a remote tensor in place")
    if func is aten.native_batch_norm.default and not meta_args[5]:
        # Out of training, the kernels give empty saved statistics; the meta kernel says [C].
        out = (out[0], out[1].new_empty(0), out[2].new_empty(0))
    return out


def _info(func) -> _Info:
    info = _infos.get(func)
    if info is None:
        info = _infos[func] = _Info(func)
    return info


def _written(op: _Op) -> list[_Value]:
    """The values an operation writes into (its `Tensor(a!)` arguments)."""
    info = _info(op.func)
    return [
        v for p, n in info.writes for v in _leaves(info.argument(op.args, op.kwargs, p, n), []) if isinstance(v, _Value)
    ]


def _view_op(base: _Value, size, stride, offset: int) -> _Op:
    """`as_strided(base, size, stride, offset)`, recorded."""
    args = (base, list(size), list(stride), offset)
    layout = (tuple(size), tuple(stride), offset, base.layout[3])
    return _Op(next(_seq), aten.as_strided.default, args, {}, [base], layout)


def _upload(dest: LazyTensor, source: torch.Tensor) -> bool:
    """`dest.copy_(source)` where `dest` is a fresh remote tensor, the whole of its storage
    (what `.to("remote_accelerator:N")` does): uploads `source` now, kept on the node."""
    value = dest._value
    fresh = (
        value.op is not None
        and value.op.func.overloadpacket in _EMPTY
        and not value.storage.writes
        and value.path == ()
        and dest.shape == source.shape
    )
    if not fresh:
        return False
    data = source.detach().to(dest.dtype).to("cpu").contiguous()
    kept = _client(None).keep(data, _node_of(value.storage.index))
    _pending.discard(value.storage)
    value.op = None
    value.leaf = kept
    value.layout, value._meta = _contiguous(data.shape, data.dtype), None
    _counters["uploads"] += 1
    return True


def _keep_on_node(storage: _Storage) -> None:
    """Computes `storage` on its node and keeps it there (see `_rebind`)."""
    tensors = list(storage.tensors)
    if tensors:
        flat = _flat(storage, tensors)
        (kept,) = _run([flat], keep=True)
        _rebind(storage, tensors, kept)
        _counters["random_results_kept"] += 1


def _flat(storage: _Storage, tensors: list) -> _Value:
    """The whole of `storage` as one value: a tensor that covers it contiguously (so that what
    is kept has that tensor's shape, which later graphs' sizes can be read from), else a flat
    view."""
    extent = _extent(tensors)
    for t in tensors:
        layout = t._value.layout
        if layout[2] == 0 and t.numel() == extent and _is_contiguous(layout):
            return t._value
    op = _view_op(tensors[0]._value, [extent], [1], 0)
    return _Value(op, (), op.out, storage)


def _rebind(storage: _Storage, tensors: list, kept: RemoteTensor) -> None:
    """Re-points the live tensors viewing `storage` at `kept`, its contents computed and kept
    on the node, so that later graphs start from there. The recorded history stays for what
    read the storage before."""
    fresh = _Storage(storage.index)
    leaf = _Value(None, (), _contiguous(kept.shape, kept.dtype), fresh, kept)
    for t in tensors:
        shape, stride, offset, dtype = t._value.layout
        if shape == leaf.layout[0] and dtype == leaf.layout[3] and offset == 0 and _is_contiguous(t._value.layout):
            t._value = leaf
        else:
            op = _view_op(leaf, shape, stride, offset)
            t._value = _Value(op, (), op.out, fresh)
        fresh.tensors.add(t)
    storage.tensors = weakref.WeakSet()
    _pending.discard(storage)


def _is_contiguous(layout) -> bool:
    shape, stride, _, _ = layout
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


def _extent(tensors) -> int:
    """Elements of storage that the tensors viewing it reach."""
    end = 1
    for t in tensors:
        shape, stride, offset, _ = t._value.layout
        if t.numel() > 0:
            end = max(end, offset + _span(shape, stride))
    return end


# ---------------------------------------------------------------------------------------------
# Factories with device="remote_accelerator:N"


def _factory(func):
    def kernel(*args, **kwargs):
        with _lock:
            return _record(func, args, kwargs)

    return kernel


_FACTORIES = [
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.zeros.default,
    aten.ones.default,
    aten.full.default,
    aten.scalar_tensor.default,
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    aten.linspace.default,
    aten.logspace.default,
    aten.eye.default,
    aten.eye.m,
    aten.rand.default,
    aten.randn.default,
    aten.randint.default,
    aten.randint.low,
    aten.randperm.default,
]


class _DeviceModule:
    """What PyTorch asks of a backend's module (`torch.remote_accelerator`)."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        pass


_library = None
_backend_error: Optional[str] = None


def _install_backend() -> None:
    global _library, _backend_error
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    try:
        _setup_privateuseone_for_python_backend(rename=DEVICE_TYPE, backend_module=_DeviceModule())
    except RuntimeError as e:  # another backend took PrivateUse1 first
        _backend_error = str(e)
        return
    _library = torch.library.Library("aten", "IMPL")
    for func in _FACTORIES:
        _library.impl(func, _factory(func), "PrivateUse1")
    _library.impl(aten._copy_from.default, _copy_from, "PrivateUse1")
    for func in _WHOLE:
        _library.impl(func, _whole(func), "PrivateUse1")


# Composite operators recorded whole rather than as what they decompose into: a kernel of the
# backend's own keeps PyTorch from decomposing them above `__torch_dispatch__`, which then
# sees the call itself. Attention so runs as the node's fused kernel, as it does eagerly.
_WHOLE = [aten.scaled_dot_product_attention.default]


def _whole(func):
    def kernel(*args, **kwargs):
        raise DjinnError(f"{func} on {DEVICE_TYPE} without a remote tensor operand")

    return kernel


def _copy_from(source: torch.Tensor, dest: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """A copy into a remote tensor where PyTorch bypasses `__torch_dispatch__` (`torch.tensor(...,
    device=...)` does)."""
    with _lock:
        return _dispatch(aten.copy_.default, (dest, source), {})


# ---------------------------------------------------------------------------------------------
# Running a graph


_nodes_of: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _node_of(index: int) -> Optional[str]:
    """The data-plane address of `remote_accelerator:index`: with a node alone, that node
    (index 0); with a control plane, its live nodes by name."""
    client = _client(None)
    if client.mode == "node":
        if index != 0:
            raise DjinnError(f"{DEVICE_TYPE}:{index}: this client reaches one node, {DEVICE_TYPE}:0")
        return None
    nodes = _nodes_of.get(client)
    if nodes is None:
        nodes = [n["inventory"]["addr"] for n in sorted(client.cluster()["nodes"], key=lambda n: n["name"])]
        _nodes_of[client] = nodes
    if index >= len(nodes):
        raise DjinnError(f"{DEVICE_TYPE}:{index}: the cluster has {len(nodes)} nodes")
    return nodes[index]


class _Plan:
    """The operations that make `targets`, in recording order, and the leaves they read."""

    def __init__(self, targets: list[_Value]):
        ops: dict[int, _Op] = {}
        leaves: dict[int, _Value] = {}
        seen_values: set[int] = set()
        seen_storages: set[int] = set()
        stack = list(targets)
        while stack:
            v = stack.pop()
            if id(v) in seen_values:
                continue
            seen_values.add(id(v))
            if v.op is None:
                leaves[id(v)] = v
            elif id(v.op) not in ops:
                ops[id(v.op)] = v.op
                stack.extend(v.op.inputs)
            if id(v.storage) not in seen_storages:
                seen_storages.add(id(v.storage))
                for w in v.storage.writes:
                    if id(w) not in ops:
                        ops[id(w)] = w
                        stack.extend(w.inputs)
        self.ops = sorted(ops.values(), key=lambda op: op.seq)
        self.targets = targets
        # Leaves in order of first use, so that the source text does not depend on the walk.
        order: dict[int, _Value] = {}
        for op in self.ops:
            for v in op.inputs:
                if v.op is None:
                    order.setdefault(id(v), v)
        for v in targets:
            if v.op is None:
                order.setdefault(id(v), v)
        self.leaves = list(order.values())
        self.written_leaves = {id(v) for v in self.leaves if v.storage.writes}


# In-place operators the allowlist has (a graph may write its own memory with them); any other
# in-place operator is written as its functional form and a `copy_` into the target.
_IN_PLACE = {aten.copy_.default, aten.index_copy_.default, aten.fill_.Scalar, aten.fill_.Tensor,
             aten.zero_.default, aten.masked_fill_.Scalar, aten.masked_fill_.Tensor}
# In-place random operators whose functional form has another overload name.
_RANDOM_FUNCTIONAL = {aten.uniform_.default: aten.uniform.default, aten.bernoulli_.float: aten.bernoulli.p,
                      aten.bernoulli_.Tensor: aten.bernoulli.Tensor}
# Program inputs take any size of their rank: a recorded graph fixes its sizes in its own
# arguments, so two recordings that differ only in their inputs' sizes are one graph.
_ANY_SIZE = f'{{"min":0,"max":{graphs.UNBOUNDED}}}'


def _functional(func):
    """The functional form of the in-place operator `func` (`add_.Tensor` -> `add.Tensor`)."""
    if func in _RANDOM_FUNCTIONAL:
        return _RANDOM_FUNCTIONAL[func]
    name = func._schema.name.split("::")[1]
    packet = getattr(aten, name[:-1], None) if name.endswith("_") and not name.endswith("__") else None
    functional = getattr(packet, func._overloadname, None) if packet is not None else None
    if functional is None:
        raise UnsupportedOperationError(f"{func} writes in place and has no functional form a graph can carry")
    return functional


class _GraphWriter:
    """A plan as a program of the graph format (`djinn.graphs`): its leaves are the inputs,
    its operations the nodes, in recording order, its targets the outputs. It writes the JSON
    text itself, each constant's text made once (`_constants`): the text is the graph's key
    in the cache, so it is written on every read."""

    def __init__(self, plan: _Plan):
        self.count = 0
        self.nodes: list[str] = []
        self.leaf_ids: dict[int, int] = {}
        self.outputs_of: dict[int, list] = {}
        self.items: dict[tuple, int] = {}
        # A size (2 or more: 0 and 1 are constants, as PyTorch specializes them) -> the first
        # (value, dimension) that has it, and the values read from there.
        self.dims: dict[int, tuple] = {}
        self.size_ids: dict[tuple, int] = {}
        inputs = []
        for k, v in enumerate(plan.leaves):
            shape, _, _, dtype = v.layout
            if dtype not in graphs._DTYPES:
                raise UnsupportedOperationError(f"a {dtype} tensor cannot be carried by a graph")
            at = self.leaf_ids[id(v)] = self.new_id()
            dims = ",".join([_ANY_SIZE] * len(shape))
            inputs.append(f'{{"name":"i{k}","value":{at},"dtype":"{graphs._DTYPES[dtype]}","dims":[{dims}]}}')
            self.note(at, v.layout)
        if not plan.leaves:
            # A graph of factories alone still takes one tensor: the call's anchor.
            inputs.append(f'{{"name":"anchor","value":{self.new_id()},"dtype":"int8","dims":[{_ANY_SIZE}]}}')
        for v in plan.leaves:
            if id(v) in plan.written_leaves:
                # Inputs are read-only to a graph (and a kept one serves later graphs too): the
                # graph writes into its own copy.
                self.leaf_ids[id(v)] = self.node("aten::clone", "", [self.arg(v)], (), 1)[0]
        for op in plan.ops:
            self.op(op)
            outputs = self.outputs_of[id(op)]
            if _is_layout(op.out):
                self.note(outputs[0], op.out)
            elif type(op.out) is tuple and len(outputs) == len(op.out):
                for at, layout in zip(outputs, op.out):
                    if _is_layout(layout):
                        self.note(at, layout)
        outputs = ",".join(self.arg(v) for v in plan.targets)
        self.text = (f'{{"format":{graphs.FORMAT},"inputs":[{",".join(inputs)}],"nodes":[{",".join(self.nodes)}],'
                     f'"outputs":[{outputs}],"weights":[]}}').encode()

    def container(self) -> bytes:
        # No weights (a captured graph takes them as inputs, kept on the node), no state.
        return graphs.container_head(self.text)

    def note(self, at: int, layout) -> None:
        for dim, n in enumerate(layout[0]):
            if n > 1:
                self.dims.setdefault(n, (at, dim))

    def size_arg(self, a) -> str:
        """A size argument: read from a tensor of the graph that has it, else a constant."""
        if type(a) is int and a > 1 and a in self.dims:
            where = self.dims[a]
            if where not in self.size_ids:
                self.size_ids[where] = self.node("native::size", "", [f'{{"v":{where[0]}}}', f'{{"i":{where[1]}}}'], (), 1)[0]
            return f'{{"v":{self.size_ids[where]}}}'
        if type(a) in (list, tuple) and a:
            return f'{{"list":[{",".join(map(self.size_arg, a))}]}}'
        return self.arg(a)

    def new_id(self) -> int:
        self.count += 1
        return self.count - 1

    def node(self, name: str, overload: str, args: list, kwargs, returns: int) -> list:
        """Writes a node; `args` and `kwargs`' values are JSON text."""
        outputs = [self.new_id() for _ in range(returns)]
        kw = ",".join(f'"{k}":{v}' for k, v in kwargs)
        self.nodes.append(f'{{"op":"{name}","overload":"{overload}","args":[{",".join(args)}],"kwargs":{{{kw}}},'
                          f'"outputs":[{",".join(map(str, outputs))}]}}')
        return outputs

    def value(self, v: _Value) -> int:
        if v.op is None:
            return self.leaf_ids[id(v)]
        outputs = self.outputs_of[id(v.op)]
        if not v.path:
            return outputs[0]
        # (i,): return i, or item i of a single list return; (i, j): item j of return i.
        head, rest = (v.path[0], v.path[1:]) if len(outputs) > 1 else (0, v.path)
        at = outputs[head]
        for i in rest:
            key = (at, i)
            if key not in self.items:
                self.items[key] = self.node("native::getitem", "", [f'{{"v":{at}}}', f'{{"i":{i}}}'], (), 1)[0]
            at = self.items[key]
        return at

    def arg(self, a) -> str:
        """An argument as JSON text."""
        t = type(a)
        if t is _Value:
            return f'{{"v":{self.value(a)}}}'
        if t is list or t is tuple:
            return f'{{"list":[{",".join(map(self.arg, a))}]}}'
        if a is _DEVICE:
            return '{"device":"node"}'
        if t is float:
            # Not cached: -0.0 == 0.0 would share a text. (`repr`: "inf", "nan", "-0.0", ...)
            return f'{{"f":"{a!r}"}}'
        key = (t, a)
        text = _constants.get(key)
        if text is None:
            try:
                text = json.dumps(graphs.encode_arg(a, lambda _: None), separators=(",", ":"))
            except graphs.ExportError as e:
                raise UnsupportedOperationError(f"cannot write it into a remote graph: {e}") from None
            if len(_constants) < _MAX_CONSTANTS:
                _constants[key] = text
        return text

    def op(self, op: _Op) -> None:
        func = op.func
        info = _infos.get(func) or _info(func)
        sizes = info.sizes
        args = [self.size_arg(a) if size else self.arg(a) for a, size in zip(op.args, info.is_size)]
        kwargs = [(k, self.size_arg(v) if k in sizes else self.arg(v)) for k, v in op.kwargs.items() if k != "generator"]
        name, overload = info.name, info.overload
        if name in graphs._ZEROED:
            # Uninitialised memory may hold another tenant's bytes: zeros instead.
            name, overload = graphs._ZEROED[name], ""
            kwargs = [(k, v) for k, v in kwargs if k != "memory_format"]
            args = args[:1] if info.name in ("aten::empty_strided", "aten::empty") else args
        elif func in (aten.lift_fresh.default, aten.lift.default):
            # Marks a tensor made from data as fresh (`torch.tensor(...)`): the tensor itself.
            self.outputs_of[id(op)] = [self.value(op.args[0])]
            return
        elif func is aten.lift_fresh_copy.default:
            name, overload = "aten::clone", ""
        elif func is aten.native_batch_norm.default:
            # (input, weight, bias, running_mean, running_var, training, momentum, eps): the
            # allowlist's forms, which say what they write.
            training, stats = op.args[5], op.args[3] is not None
            if training and stats:
                raise UnsupportedOperationError(f"{func} in training mode, updating running statistics")
            if stats:
                name, overload = "aten::_native_batch_norm_legit_no_training", ""
                args = args[:5] + args[6:]
            else:
                name, overload = "aten::_native_batch_norm_legit", "no_stats"
                args = args[:3] + args[5:]
        elif func is aten.normal_.default:
            # normal_(x, mean, std): randn_like(x) * std + mean, written into x.
            given = {**dict(zip(("mean", "std"), op.args[1:])), **op.kwargs}
            mean, std = given.get("mean", 0.0), given.get("std", 1.0)
            (r,) = self.node("aten::randn_like", "generator", [args[0]], (), 1)
            (r,) = self.node("aten::mul", "Tensor", [f'{{"v":{r}}}', self.arg(float(std))], (), 1)
            (r,) = self.node("aten::add", "Tensor", [f'{{"v":{r}}}', self.arg(float(mean))], (), 1)
            self.outputs_of[id(op)] = self.node("aten::copy_", "", [args[0], f'{{"v":{r}}}'], (), 1)
            return
        elif func is aten.native_dropout.default:
            # (input, p, train) -> (output, mask), as eager PyTorch draws it for a device
            # backend, with the node's generator: mask ~ Bernoulli(1 - p), output = input *
            # mask / (1 - p).
            p, train = op.args[1], op.args[2]
            if train is False:
                (out,) = self.node("aten::clone", "", args[:1], (), 1)
                (mask,) = self.node("aten::ones_like", "", args[:1], [("dtype", self.arg(torch.bool))], 1)
            else:
                keep = 1.0 - p
                (m,) = self.node("aten::bernoulli", "p", [args[0], self.arg(keep)], (), 1)
                (out,) = self.node("aten::mul", "Tensor", [args[0], f'{{"v":{m}}}'], (), 1)
                (out,) = self.node("aten::mul", "Scalar", [f'{{"v":{out}}}', self.arg(1.0 / keep if keep else 0.0)], (), 1)
                (mask,) = self.node("aten::ne", "Scalar", [f'{{"v":{m}}}', self.arg(0)], (), 1)
            self.outputs_of[id(op)] = [out, mask]
            return
        elif info.writes and func not in _IN_PLACE:
            functional = _functional(func)
            fname, foverload = functional._schema.name, functional._schema.overload_name
            (r,) = self.node(fname, graphs._WITH_GENERATOR.get((fname, foverload), foverload), args, kwargs, 1)
            self.outputs_of[id(op)] = self.node("aten::copy_", "", [args[0], f'{{"v":{r}}}'], (), 1)
            return
        self.outputs_of[id(op)] = self.node(name, overload, args, kwargs, info.n_returns)


# A constant argument (its type and value) -> its JSON text.
_constants: dict = {}
_MAX_CONSTANTS = 1 << 14


class _Graph:
    """A graph as registered: its container, its semantic graph, and the RemoteModel it is
    registered as, per client."""

    __slots__ = ("archive", "srg", "registered")

    def __init__(self, archive: bytes, srg: SemanticGraph):
        self.archive = archive
        self.srg = srg
        self.registered: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


_graphs: dict[bytes, _Graph] = {}
_MAX_GRAPHS = 4096


def _run(targets: list[_Value], keep: bool = False, plan: Optional[_Plan] = None) -> list:
    """Runs the graph that makes `targets` on their node: their data (CPU tensors), or with
    `keep`, RemoteTensors kept there."""
    global _last_graph
    plan = plan or _Plan(targets)
    started = time.perf_counter_ns()
    container = _GraphWriter(plan).container()
    _counters["write_ns"] += time.perf_counter_ns() - started
    graph = _graphs.get(container)
    if graph is None:
        graph = _Graph(container, annotate(plan))
        if len(_graphs) >= _MAX_GRAPHS:
            _graphs.clear()
        _graphs[container] = graph
        _counters["graphs_built"] += 1
    else:
        _counters["graph_cache_hits"] += 1
    client = _client(None)
    model = graph.registered.get(client)
    if model is None:
        started = time.perf_counter_ns()
        model = RemoteModel(client, [graph.archive], None, graph.srg.description(), None)
        _counters["register_ns"] += time.perf_counter_ns() - started
        graph.registered[client] = model
        graph.srg.fingerprint = model.fingerprint
    call = CallTensors()
    leaves = [v.leaf for v in plan.leaves] or [torch.empty(0, dtype=torch.int8)]
    wire = [call.flatten(leaf) for leaf in leaves]
    at = _node_of(targets[0].storage.index)
    if at is None and call.nodes:
        at = call.nodes[0]
    started = time.perf_counter_ns()
    out = client._native.execute(model.fingerprint, wire, call.tensors, keep, at)
    _counters["execute_ns"] += time.perf_counter_ns() - started
    _counters["graph_executions"] += 1
    _last_graph = graph.srg
    out = unflatten(out, client)
    return list(out) if len(targets) > 1 else [out]


def _order(v: _Value) -> tuple:
    return (v.op.seq if v.op is not None else -1, v.path)


def _materialize(tensors: list) -> list[torch.Tensor]:
    """The data of `tensors`, computed on their node, with every other pending storage that live
    tensors view (`_pending`: a KV cache grown by `cat` or updated in place, the next step's
    position ids): those are kept on the node as they are afterwards, so that the next graph
    starts from them instead of replaying their history. The graph then keeps its outputs
    too, and the targets are fetched."""
    with _lock:
        targets = [t._value for t in tensors]
        wanted = {id(t) for t in tensors}
        index = targets[0].storage.index
        # (An empty tensor has nothing to keep; one on another node waits for a read there.)
        state = [
            (s, live)
            for s in list(_pending)
            if s.index == index
            and (live := list(s.tensors))
            and any(id(t) not in wanted for t in live)
            and any(t.numel() for t in live)
        ]
        # In recording order, so that the same steps write the same graph.
        state.sort(key=lambda e: min(_order(t._value) for t in e[1]))
        try:
            if state:
                try:
                    kept = _run(targets + [_flat(s, live) for s, live in state], keep=True)
                except DjinnError:
                    # Something pending that was not asked for fails: it stays recorded (and
                    # fails when it is read); what was asked for runs alone.
                    state = []
                else:
                    for (storage, live), k in zip(state, kept[len(targets) :]):
                        _rebind(storage, live, k)
                    outputs = [k.cpu() for k in kept[: len(targets)]]
                    _counters["state_kept"] += 1
            if not state:
                outputs = _run(targets)
        finally:
            for s in list(_pending):
                if s.index == index:
                    _pending.discard(s)
    for t, o in zip(tensors, outputs):
        if o.shape != t.shape or o.dtype != t.dtype:
            raise DjinnError(f"the node returned {o.dtype}{list(o.shape)} for a {t.dtype}{list(t.shape)} tensor")
    return outputs


# ---------------------------------------------------------------------------------------------
# The API


def get_graph(*tensors: torch.Tensor) -> Optional[SemanticGraph]:
    """The semantic graph that makes `tensors` (nothing runs), or with no arguments that of
    the last graph run on a node (None before any)."""
    if not tensors:
        return _last_graph
    for t in tensors:
        if not isinstance(t, LazyTensor):
            raise TypeError(f"get_graph takes tensors on {DEVICE_TYPE}, not {type(t).__name__}")
    with _lock:
        return annotate(_Plan([t._value for t in tensors]))


@contextlib.contextmanager
def capture(device: int = 0):
    """Inside, tensors created without a device are created on `remote_accelerator:device`
    (and so are the weights of modules built inside): operations on them are recorded, and run
    on the node when a result is read."""
    if _backend_error is not None:
        raise DjinnError(f"capture is unavailable: {_backend_error}")
    with torch.device(DEVICE_TYPE, device):
        yield


_install_backend()
