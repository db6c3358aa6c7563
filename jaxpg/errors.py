"""The error classes callers catch, named as torch.distributed names them."""

from __future__ import annotations

from collections.abc import Callable

__all__ = [
    "DistError",
    "DiscardedResultWarning",
    "DistBackendError",
    "DistDesyncError",
    "DistNetworkError",
    "DistStoreError",
    "DistTimeoutError",
]


_failure_hooks: list[Callable[[BaseException], None]] = []


def on_failure(hook: Callable[[BaseException], None]) -> None:
    """Registers ``hook(error)``, called when a ``DistTimeoutError``, ``DistNetworkError`` or
    ``DistDesyncError`` is made (the flight recorder dumps there: every place that raises
    one is covered). A failing hook is ignored."""
    if hook not in _failure_hooks:
        _failure_hooks.append(hook)


class DistError(RuntimeError):
    """Base class of every error jaxpg raises for a distributed failure."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        if _failure_hooks and isinstance(self, (DistTimeoutError, DistNetworkError,
                                                DistDesyncError)):
            for hook in list(_failure_hooks):
                try:
                    hook(self)
                except Exception:  # noqa: BLE001 (reporting must not hide the error)
                    pass


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
