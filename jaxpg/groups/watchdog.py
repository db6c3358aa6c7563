"""Eager collectives' per-backend semantics, and the watchdog of the stream-ordered ones.

torch's rules, which jaxpg follows in multi-process runs:

* gloo (CPU): a plain eager collective blocks until done and raises a named
  ``DistTimeoutError`` after the group's timeout (``blocking_wait()`` is True).
* NCCL / TPU: it returns at once, ordered after earlier device work, and a watchdog thread
  in each process watches every outstanding collective of every group. When one is not done
  by its deadline, the watchdog prints the ``DistTimeoutError`` text (op, group, sequence
  number, missing ranks) to stderr and ends the process with ``WATCHDOG_EXIT_CODE``, so the
  launcher stops the job (torch's ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default).
  ``JAXPG_BLOCKING_WAIT=1`` (or torch's ``TORCH_NCCL_BLOCKING_WAIT=1``) gives the blocking,
  raising behaviour instead; ``JAXPG_ASYNC_ERROR_HANDLING=0`` (or
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``) makes the watchdog print without ending the process.

``_JAXPG_STREAM_SEMANTICS=1`` is a private switch that gives a CPU world the accelerator
rules, so that the tests exercise the watchdog through the same code on CPU.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["blocking_wait", "watch", "forget", "Outstanding", "WATCHDOG_EXIT_CODE"]

WATCHDOG_EXIT_CODE = 6  # what a process torn down by torch's NCCL watchdog (SIGABRT) reports
_TRUE = ("1", "true", "yes", "on")


def _env_flag(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip():
            return value.strip().lower()
    return None


def blocking_wait(platform: str) -> bool:
    """Whether plain eager collectives block and raise (True) or return at once (False).

    Args:
        platform: JAX's platform of the world's devices ("cpu", "gpu", "tpu", ...).
    """
    forced = _env_flag("JAXPG_BLOCKING_WAIT", "TORCH_NCCL_BLOCKING_WAIT")
    if forced is not None:
        return forced in _TRUE
    if _env_flag("_JAXPG_STREAM_SEMANTICS") in _TRUE:
        return False
    return platform == "cpu"


def _tears_down() -> bool:
    value = _env_flag("JAXPG_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
    return value is None or value != "0"


class Outstanding:
    """One watched collective: registered before its dispatch (which may itself block, on
    CPU), given its output array after it; ready once that array is."""

    __slots__ = ("deadline", "describe", "array", "failed")

    def __init__(self, deadline: float, describe: Callable[[], str]) -> None:
        self.deadline = deadline
        self.describe = describe
        self.array: Any = None
        self.failed = False

    def is_ready(self) -> bool:
        if self.failed:
            return True
        array = self.array
        return array is not None and array.is_ready()


class _Watchdog:
    """One daemon thread over a FIFO of ``Outstanding`` collectives.

    Collectives finish in the order they were queued on the device, so the thread only looks
    at the oldest entry: it drops it once its array is ready, and fires once its deadline
    passed first. ``watch`` is a ``deque.append`` (no lock, no wake-up): the thread polls every
    ``_PERIOD`` seconds, which bounds both how late it fires and how long it keeps a finished
    collective's output alive.
    """

    _PERIOD = 0.02

    def __init__(self, autostart: bool = True) -> None:
        self._autostart = autostart  # False: no thread; ``_check`` is called by hand (tests)
        self._pending: collections.deque = collections.deque()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.fired: str | None = None  # the text of the last timeout (for in-process tests)

    def watch(self, deadline: float, describe: Callable[[], str]) -> Outstanding:
        entry = Outstanding(deadline, describe)
        self._pending.append(entry)
        if self._thread is None and self._autostart:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name="jaxpg-watchdog",
                                                    daemon=True)
                    self._thread.start()
        return entry

    def forget(self) -> None:
        self._pending.clear()

    def _loop(self) -> None:
        while True:
            self._check()
            time.sleep(self._PERIOD)

    def _check(self) -> None:
        pending = self._pending
        while pending:
            try:
                entry = pending[0]
            except IndexError:  # forget() ran meanwhile
                return
            try:
                ready = entry.is_ready()
            except Exception:  # noqa: BLE001 (a failed collective is no longer outstanding)
                ready = True
            if ready:
                pending.popleft()
                continue
            if time.monotonic() < entry.deadline:
                return
            pending.popleft()
            self._fire(entry.describe)

    def _fire(self, describe: Callable[[], str]) -> None:
        try:
            text = describe()
        except Exception as err:  # noqa: BLE001 (say what we know, then still tear down)
            text = f"a collective timed out (its description failed: {err!r})"
        tear_down = _tears_down()
        print(f"[jaxpg watchdog] DistTimeoutError: {text}"
              + (" Ending the process (JAXPG_ASYNC_ERROR_HANDLING=0 keeps it running; "
                 "JAXPG_BLOCKING_WAIT=1 raises in the caller instead)." if tear_down else ""),
              file=sys.stderr, flush=True)
        if tear_down:
            os._exit(WATCHDOG_EXIT_CODE)
        self.fired = text  # last: a test that waits for it has seen the whole firing


_watchdog = _Watchdog()


def watch(deadline: float, describe: Callable[[], str]) -> Outstanding:
    """Watches one collective about to be dispatched: set the returned entry's ``array``
    (one of its outputs) after the dispatch, or ``failed`` if it raised. Unless that array
    is ready by ``deadline`` (``time.monotonic()``), the watchdog prints ``describe()`` and
    ends the process."""
    return _watchdog.watch(deadline, describe)


def forget() -> None:
    """Stops watching everything outstanding (``destroy_process_group``)."""
    _watchdog.forget()
