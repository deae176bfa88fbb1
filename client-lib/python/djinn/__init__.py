"""Run PyTorch models on a Djinn node as if they were local.

    import djinn
    djinn.init("http://127.0.0.1:7000")          # the control plane (`djinn up`), or a node's HOST:PORT
    rm = djinn.register(model, example_inputs)   # placed by the control plane, uploaded once
    y = rm(x)                                     # sends only the fingerprint and x
    h = rm(x, keep=True)                          # the output stays on the node: a RemoteTensor
    z = rm2(h).cpu()                              # h is used where it is, without crossing the network
    p = rm.run_until(2, x)                        # stop after block 2: p.activation, p.resume(...), p.abort()

A model travels as a graph (`torch.export`, checked by the node), whole or in blocks: cut
after submodules with `split=`, or given as `blocks=[...]` (submodules or functions in
execution order, each taking the one before's output; registration checks that, chained,
they reproduce the model's output on the example inputs).

The package's rooms, each importing only those above it: `errors`, `tensors` (wire dtypes,
RemoteTensor), `_wire` (a call's values and the tensors it sends), `graphs`, `cache`,
`breakpoints`, `sessions`, `models`, `client`, `_recording` and `srg`, `capture`. This file
only re-exports.
"""

from .breakpoints import Paused
from .capture import LazyTensor, capture, get_graph
from .client import Client, init, register, remote, stats, status
from .errors import (
    AuthenticationError,
    BadArchiveError,
    BadReplyError,
    BlockMismatchError,
    BreakpointError,
    ControlPlaneError,
    DeadlineExceededError,
    ExecutorLostError,
    DjinnError,
    ExecutionError,
    ExportError,
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
    UntrustedAddressError,
)
from .models import RemoteModel
from .sessions import Session, session
from .tensors import RemoteTensor

__all__ = [
    "AuthenticationError",
    "BadArchiveError",
    "BadReplyError",
    "BlockMismatchError",
    "BreakpointError",
    "Client",
    "ControlPlaneError",
    "DeadlineExceededError",
    "ExecutorLostError",
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
    "UntrustedAddressError",
    "capture",
    "get_graph",
    "init",
    "register",
    "remote",
    "session",
    "stats",
    "status",
]
