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


class _Value:
    """A tensor of the recording: output `path` of `op`, or a leaf (`op` None) whose data is
    `leaf`, a local tensor sent with the graph or a RemoteTensor kept on the node."""

    __slots__ = ("op", "path", "meta", "storage", "leaf", "sig")

    def __init__(self, op, path, meta: torch.Tensor, storage: _Storage, leaf=None):
        self.op = op
        self.path = path
        self.storage = storage
        self.leaf = leaf
        self.set_meta(meta)

    def set_meta(self, meta: torch.Tensor) -> None:
        self.meta = meta
        # What shape inference depends on.
        self.sig = (tuple(meta.shape), meta.stride(), meta.storage_offset(), meta.dtype)


class _Op:
    """One recorded aten call. `args`/`kwargs` hold _Values where tensors were and `_DEVICE`
    where the remote device was."""

    __slots__ = ("seq", "func", "args", "kwargs", "inputs", "out", "created")

    def __init__(self, seq: int, func, args, kwargs, inputs: list, out):
        self.seq = seq
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.inputs = inputs
        # What the call returned on the meta device.
        self.out = out
        # The storages its outputs are the first to view (weakly: a storage goes with its
        # last tensor).
        self.created: list = []


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
