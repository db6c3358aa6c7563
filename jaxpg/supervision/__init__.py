"""Supervision of a multi-process run: watchdog, liveness, progress records, desync checks,
hang diagnosis, recorded steps, the flight recorder and its analyzer (``fr_trace``).

The public names are ``jaxpg.supervision.recorded_step``, ``RecordedStep`` and
``dump_flight_recorder``. This package's ``__init__`` imports nothing: each name loads its
module on first access (PEP 562), so that the launcher (``jaxpg.run``), which imports
supervision modules, loads no jax, and importing one module does not load the others.
"""

import importlib

_NAMES = {"recorded_step": "jaxpg.supervision.step_recording",
          "RecordedStep": "jaxpg.supervision.step_recording",
          "dump_flight_recorder": "jaxpg.supervision.fr_on_demand"}

__all__ = list(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))
