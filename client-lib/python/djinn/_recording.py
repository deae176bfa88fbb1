"""What capture records: storages, values and the aten calls between them, shared by the
recorder (`capture`) and the semantic graph (`srg`)."""

from __future__ import annotations

import weakref

import torch


class _Storage:
    """The memory behind a base tensor and its views, as the recording sees it: the writes
    made to it, in order, and the live LazyTensors that view it."""

    __slots__ = ("index", "writes", "tensors", "__weakref__")

    def __init__(self, index: int):
        self.index = index
        self.writes: list[_Op] = []
        self.tensors: weakref.WeakSet = weakref.WeakSet()


def _layout(meta: torch.Tensor) -> tuple:
    """A tensor's layout as recording keeps it: (shape, stride, storage offset, dtype)."""
    return (tuple(meta.shape), meta.stride(), meta.storage_offset(), meta.dtype)


def _contiguous(shape, dtype) -> tuple:
    """The layout of a contiguous tensor of `shape`."""
    stride, n = [], 1
    for size in reversed(shape):
        stride.append(n)
        n *= max(size, 1)
    return (tuple(shape), tuple(reversed(stride)), 0, dtype)


def _span(shape, stride) -> int:
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0


def _meta_of(layout):
    """Meta tensors with the layouts `layout` holds (a layout, or lists and tuples of them)."""
    if isinstance(layout, tuple) and len(layout) == 4 and isinstance(layout[3], torch.dtype):
        shape, stride, offset, dtype = layout
        if offset == 0:
            return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        return torch.empty(offset + _span(shape, stride), dtype=dtype, device="meta").as_strided(shape, stride, offset)
    if isinstance(layout, (list, tuple)):
        return type(layout)(_meta_of(x) for x in layout)
    return layout


class _Value:
    """A tensor of the recording: output `path` of `op`, or a leaf (`op` None) whose data is
    `leaf`, a local tensor sent with the graph or a RemoteTensor kept on the node. Its layout
    is what shape inference depends on; a meta tensor of it is made only when asked for."""

    __slots__ = ("op", "path", "layout", "storage", "leaf", "_meta")

    def __init__(self, op, path, layout: tuple, storage: _Storage, leaf=None):
        self.op = op
        self.path = path
        self.layout = layout
        self.storage = storage
        self.leaf = leaf
        self._meta = None

    @property
    def meta(self) -> torch.Tensor:
        if self._meta is None:
            self._meta = _meta_of(self.layout)
        return self._meta


class _Op:
    """One recorded aten call. `args`/`kwargs` hold _Values where tensors were and `_DEVICE`
    where the remote device was."""

    __slots__ = ("seq", "func", "args", "kwargs", "inputs", "out")

    def __init__(self, seq: int, func, args, kwargs, inputs: list, out):
        self.seq = seq
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.inputs = inputs
        # The layouts of what the call returns (as `_meta_of` takes them), and its other
        # results as they are.
        self.out = out


class _DeviceArg:
    def __repr__(self) -> str:
        return "dev"


_DEVICE = _DeviceArg()


def _walk(value, fn):
    """`value` with `fn` applied to every leaf of its tuples, lists and dicts."""
    if isinstance(value, (list, tuple)):
        return type(value)(_walk(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _walk(v, fn) for k, v in value.items()}
    return fn(value)


def _to_meta(v):
    if isinstance(v, _Value):
        return v.meta
    if v is _DEVICE:
        return torch.device("meta")
    return v


def _meta_args_of(args, kwargs) -> tuple:
    return _walk(args, _to_meta), {k: _walk(v, _to_meta) for k, v in kwargs.items()}


def _meta_args(op: _Op) -> tuple:
    """An operation's arguments with meta tensors for its values (for cost formulas)."""
    return _meta_args_of(op.args, op.kwargs)
