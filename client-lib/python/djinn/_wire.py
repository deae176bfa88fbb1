"""The wire form of a call's values: nested Python values with `TensorSlot(i)` where tensor i
travels and the native `Kept` where a RemoteTensor is used on its node; and back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from . import _native, _stats
from .errors import DjinnError
from .tensors import WIRE_DTYPES, RemoteTensor, from_buffer

if TYPE_CHECKING:
    from .client import Client


class CallTensors:
    """The tensors one call sends, and the nodes of the RemoteTensors it uses.

    `flatten(value)` returns `value`'s wire form and collects each tensor in it as a
    contiguous CPU tensor: the caller's own when it is one already (sent from its memory, no
    copy), else a copy made here. Every tensor, whatever its strides, device or dtype, takes
    this one path. The native call takes `tensors` through DLPack and holds each one itself for
    as long as it may read a byte of it, errors and timeouts included, so this object need not
    outlive the call."""

    __slots__ = ("tensors", "nodes")

    def __init__(self):
        self.tensors: list[torch.Tensor] = []
        self.nodes: list[str] = []

    def flatten(self, value):
        if isinstance(value, RemoteTensor):
            value._check()
            self.nodes.append(value.node)
            return value._kept
        if isinstance(value, torch.Tensor):
            self.tensors.append(_sendable(value))
            return _native.TensorSlot(len(self.tensors) - 1)
        if isinstance(value, tuple):
            return tuple(self.flatten(v) for v in value)
        if isinstance(value, list):
            return [self.flatten(v) for v in value]
        if isinstance(value, dict):
            return {k: self.flatten(v) for k, v in value.items()}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if type(value).__module__ == "numpy":
            raise TypeError(
                f"a numpy {type(value).__name__} is not sent as it is: pass torch.from_numpy(a) "
                "(no copy), as the model would need locally"
            )
        raise TypeError(f"cannot send a {type(value).__name__} to a remote model")

    def node(self) -> Optional[str]:
        """The one node holding the RemoteTensors used (None when there are none)."""
        if not self.nodes:
            return None
        if len(set(self.nodes)) > 1:
            raise DjinnError(
                f"the RemoteTensor inputs are on several nodes ({', '.join(sorted(set(self.nodes)))}): push them to one first"
            )
        return self.nodes[0]


def _sendable(value: torch.Tensor) -> torch.Tensor:
    """`value` as a contiguous CPU tensor, copied only when it is not one."""
    t = value.detach()
    if t.dtype not in WIRE_DTYPES:
        raise TypeError(f"tensors of {t.dtype} cannot be sent (supported: {', '.join(map(str, WIRE_DTYPES))})")
    own = t
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t is not own:
        _stats.count(_stats.wire, "input_copies")
        _stats.count(_stats.wire, "input_copy_bytes", t.numel() * t.element_size())
    return t


def unflatten(value, client: Client):
    """A native result as Python values: CPU tensors over the received bytes, RemoteTensors
    for the tensors kept on the node."""
    if isinstance(value, _native.Kept):
        return RemoteTensor(value, client)
    if isinstance(value, _native.OutputTensor):
        return from_buffer(value, value.dtype, value.shape)
    if isinstance(value, tuple):
        return tuple(unflatten(v, client) for v in value)
    if isinstance(value, list):
        return [unflatten(v, client) for v in value]
    if isinstance(value, dict):
        return {k: unflatten(v, client) for k, v in value.items()}
    return value
