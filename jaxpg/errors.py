"""The error classes callers catch, named as torch.distributed names them."""

from __future__ import annotations

__all__ = [
    "DistError",
    "DiscardedResultWarning",
    "DistBackendError",
    "DistDesyncError",
    "DistNetworkError",
    "DistStoreError",
    "DistTimeoutError",
]


class DistError(RuntimeError):
    """Base class of every error jaxpg raises for a distributed failure."""


class DistBackendError(DistError):
    """A backend (XLA collectives, the coordination service) failed or is unavailable."""


class DistNetworkError(DistError):
    """A peer could not be reached, or went away."""


class DistStoreError(DistError):
    """A key/value store operation failed or timed out."""


class DistTimeoutError(DistError, TimeoutError):
    """A collective or barrier did not finish in time; the message names the missing ranks."""


class DistDesyncError(DistError):
    """Ranks called different collectives (op, shapes, dtypes or arguments) at the same point;
    raised under ``JAXPG_DEBUG=DETAIL``, naming the ranks and both calls."""


class DiscardedResultWarning(UserWarning):
    """Host code dropped a collective's result; jaxpg returns results instead of changing
    its arguments in place, as torch.distributed does (``t = jaxpg.all_reduce(t)``)."""
