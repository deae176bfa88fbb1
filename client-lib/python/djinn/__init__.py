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

The package's rooms, each importing only those above it: `errors`, `tensors` (wire dtypes,
RemoteTensor), `_wire` (a call's values and the tensors it sends), `breakpoints`, `sessions`,
`models`, `client`, `_recording` and `srg`, `capture`. This file only re-exports.
"""

from .breakpoints import Paused
from .capture import LazyTensor, capture, get_graph
from .client import Client, init, register, remote, stats, status
from .errors import (
    AuthenticationError,
    BadArchiveError,
    BlockMismatchError,
    BreakpointError,
    ControlPlaneError,
    DjinnError,
    ExecutionError,
    HandleLostError,
    NotFoundError,
    OverBudgetError,
    QuotaExceededError,
    GraphRefusedError,
    RemoteError,
    StaleHandleError,
    TransportError,
    UnknownModelError,
    UnsupportedOperationError,
)
from .models import RemoteModel
from .sessions import Session, session
from .tensors import RemoteTensor

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
    "LazyTensor",
    "NotFoundError",
    "OverBudgetError",
    "Paused",
    "QuotaExceededError",
    "GraphRefusedError",
    "RemoteError",
    "RemoteModel",
    "RemoteTensor",
    "Session",
    "StaleHandleError",
    "TransportError",
    "UnknownModelError",
    "UnsupportedOperationError",
    "capture",
    "get_graph",
    "init",
    "register",
    "remote",
    "session",
    "stats",
    "status",
]
