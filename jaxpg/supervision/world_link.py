"""What supervision needs from the world model, registered by ``jaxpg.groups`` (the layer
above), so that supervision never imports it.

Two supervision calls reach up: ``dump_flight_recorder()`` and a recorded step's launch
need the running world, and a recorded step numbers a program over a mesh on a
``ProcessGroup`` of its devices. ``jaxpg.groups.world`` registers both when it is imported,
which is always before a world can exist: with nothing registered there is no world.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["register", "current_world", "group_type"]

_NOT_INITIALIZED = (
    "Default process group has not been initialized, please make sure to call "
    "init_process_group."
)

_current: Callable[[bool], Any] | None = None
_group_type: type | None = None


def register(current: Callable[[bool], Any], process_group_type: type) -> None:
    """Sets how the world is found (``current(required)``, as ``jaxpg.groups.world.current``)
    and the class of its process groups (``cls(state, ranks, name=...)``)."""
    global _current, _group_type
    _current, _group_type = current, process_group_type


def current_world(required: bool = True) -> Any | None:
    """The running world's state; without one, None or (``required``) torch's ValueError."""
    if _current is not None:
        return _current(required)
    if required:
        raise ValueError(_NOT_INITIALIZED)
    return None


def group_type() -> type | None:
    """The process-group class of the world model, or None before ``jaxpg.groups`` is
    imported (then no process group exists either)."""
    return _group_type
