"""Every error the package raises, under `DjinnError`. Each presents itself as `djinn.<Name>`."""

from ._native import (
    AuthenticationError,
    BadArchiveError,
    BadReplyError,
    BreakpointError,
    ControlPlaneError,
    DeadlineExceededError,
    ExecutorLostError,
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
    UntrustedAddressError,
)
from .graphs import ExportError

__all__ = [
    "AuthenticationError",
    "BadArchiveError",
    "BadReplyError",
    "BlockMismatchError",
    "BreakpointError",
    "ControlPlaneError",
    "ExportError",
    "DeadlineExceededError",
    "ExecutorLostError",
    "DjinnError",
    "ExecutionError",
    "HandleLostError",
    "NotFoundError",
    "OverBudgetError",
    "QuotaExceededError",
    "GraphRefusedError",
    "RemoteError",
    "StaleHandleError",
    "TransportError",
    "UnknownModelError",
    "UnsupportedOperationError",
    "UntrustedAddressError",
]


class BlockMismatchError(DjinnError, ValueError):
    """The blocks given, run in order, do not reproduce the model's output."""

    __module__ = "djinn"


class UnsupportedOperationError(DjinnError):
    """An operation on remote tensors that capture cannot record or the node cannot run."""

    __module__ = "djinn"
