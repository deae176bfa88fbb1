"""Tensors on the wire and on nodes: the dtypes that travel, tensors over received bytes, and
`RemoteTensor`, a tensor kept in a node's device memory."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from .errors import DjinnError

if TYPE_CHECKING:
    from .client import Client

WIRE_DTYPES = {
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
TORCH_DTYPES = {name: dtype for dtype, name in WIRE_DTYPES.items()}


def from_buffer(buffer, dtype: str, shape) -> torch.Tensor:
    """A CPU tensor over `buffer` (received bytes, writable), without a copy."""
    if 0 in shape:
        return torch.empty(tuple(shape), dtype=TORCH_DTYPES[dtype])
    return torch.frombuffer(buffer, dtype=TORCH_DTYPES[dtype]).view(tuple(shape))


class RemoteTensor:
    """A tensor kept in a node's device memory: the output of `rm(..., keep=True)`,
    `client.keep(t)` or `t.push(node)`. Passed to a model on its node, it does not cross the
    network. `.cpu()` brings its bytes back. It is freed when released or garbage-collected,
    or by the node after its `--handle-ttl` unused. If its node dies or restarts, it is gone:
    using it raises HandleLostError or StaleHandleError."""

    __module__ = "djinn"
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
        return TORCH_DTYPES[self._kept.dtype]

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
        return from_buffer(fetched, self._kept.dtype, self._kept.shape)

    def push(self, node: str) -> RemoteTensor:
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
