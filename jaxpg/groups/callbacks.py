"""Callbacks that the layers above ``groups`` register, so that ``groups`` never imports them.

The groups layer sits below the collectives and ``jaxpg.spmd``, yet two of its calls need
something from up there:

* ``destroy_process_group`` must make the upper layers forget what they cached for the old
  world (the eager path's compiled kernels): each such layer registers a *reset* callback.
* ``get_rank`` inside SPMD code returns the traced rank, which only the active SPMD context
  knows: ``jaxpg.spmd`` registers a *traced rank* callback.

Registration happens when the upper module is imported, which is always before the state
it caches or the context it pushes can exist.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["on_reset", "run_resets", "set_traced_rank", "traced_rank"]

_resets: list[Callable[[], None]] = []
_traced_rank: Callable[[Any], Any] | None = None


def on_reset(callback: Callable[[], None]) -> Callable[[], None]:
    """Registers ``callback`` to run at ``destroy_process_group`` of the world (once each).

    Returns ``callback``, so it can be used as a decorator.
    """
    if callback not in _resets:
        _resets.append(callback)
    return callback


def run_resets() -> None:
    """Runs every reset callback, in registration order."""
    for callback in list(_resets):
        callback()


def set_traced_rank(callback: Callable[[Any], Any]) -> None:
    """Sets how a group's traced rank is found: ``callback(group)`` returns it inside SPMD
    code, or None in host code."""
    global _traced_rank
    _traced_rank = callback


def traced_rank(group: Any) -> Any | None:
    """The traced rank of ``group`` inside SPMD code; None in host code."""
    return None if _traced_rank is None else _traced_rank(group)
