"""Compile time per thread, so that a collective's timeout does not count it.

The first call of a jitted step (or of an eager kernel) traces, lowers and compiles before
anything runs, which can take longer than a short group timeout on a loaded machine.
JAX reports each phase through ``jax.monitoring``: a scalar event when it starts (its start
time) and a duration event when it ends (``/jax/core/compile/jaxpr_trace_duration``,
``jaxpr_to_mlir_module_duration`` and ``backend_compile_duration``, the same names in jax
0.10.2 and 0.12). This module listens to them and keeps, for each thread, whether it is
compiling now and how many seconds it spent compiling so far; a waiter subtracts the
compile seconds of the thread that dispatches its collective.
"""

from __future__ import annotations

import threading
import time

__all__ = ["install", "seconds", "compiling"]

_EVENTS = frozenset({
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
})
# thread ident -> [phases open now, seconds of finished phases, monotonic start of the open one]
_threads: dict[int, list[float]] = {}
_installed = False
_lock = threading.Lock()


def _on_start(event: str, value: float, **_: object) -> None:
    if event in _EVENTS:
        state = _threads.setdefault(threading.get_ident(), [0, 0.0, 0.0])
        if state[0] == 0:
            state[2] = time.monotonic()
        state[0] += 1


def _on_end(event: str, duration: float, **_: object) -> None:
    if event in _EVENTS:
        state = _threads.get(threading.get_ident())
        if state is None or state[0] == 0:
            return
        state[0] -= 1
        if state[0] == 0:
            state[1] += time.monotonic() - state[2]


def install() -> None:
    """Starts listening to JAX's compile events (once per process)."""
    global _installed
    with _lock:
        if _installed:
            return
        import jax.monitoring

        jax.monitoring.register_scalar_listener(_on_start)
        jax.monitoring.register_event_duration_secs_listener(_on_end)
        _installed = True


def seconds(thread: int) -> float:
    """Seconds thread ``thread`` (an ident) spent compiling so far, the open phase included."""
    state = _threads.get(thread)
    if state is None:
        return 0.0
    return state[1] + (time.monotonic() - state[2] if state[0] > 0 else 0.0)


def compiling(thread: int) -> bool:
    """Whether thread ``thread`` is tracing, lowering or compiling now."""
    state = _threads.get(thread)
    return state is not None and state[0] > 0
