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

from jaxpg.supervision import compile_clock

__all__ = ["blocking_wait", "watch", "forget", "Outstanding", "WATCHDOG_EXIT_CODE",
           "before_teardown"]

WATCHDOG_EXIT_CODE = 6  # what a process torn down by torch's NCCL watchdog (SIGABRT) reports
_TRUE = ("1", "true", "yes", "on")
_teardown_hooks: list[Callable[[str], None]] = []


def before_teardown(hook: Callable[[str], None]) -> None:
    """Registers ``hook(text)``, called with the error's text when the watchdog fires,
    before it ends the process (the flight recorder dumps there)."""
    if hook not in _teardown_hooks:
        _teardown_hooks.append(hook)


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
    CPU), given its output array after it; ready once that array is.

    ``describe()`` gives the timeout's text, or ``(text, extend)`` where ``extend`` says a
    peer still compiles the call (then the deadline moves on by the same span). Time the
    dispatching ``thread`` spends compiling does not count. ``failure(error)`` gives the
    text when the collective itself failed in XLA; ``record`` (the flight recorder's) is
    marked completed once the output is ready; ``report()`` is called at each look while
    the collective is outstanding and not yet due (the hang lines,
    ``jaxpg.supervision.hang_report``).
    """

    __slots__ = ("deadline", "describe", "array", "failed", "span", "thread", "compiled",
                 "record", "rid", "failure", "report")

    def __init__(self, deadline: float, describe: Callable[[], Any], thread: int | None = None,
                 record: Any = None, failure: Callable[[str], str] | None = None,
                 report: Callable[[], None] | None = None) -> None:
        self.deadline = deadline
        self.span = max(deadline - time.monotonic(), 0.0)
        self.describe = describe
        self.array: Any = None
        self.failed = False
        self.thread = thread
        self.compiled = compile_clock.seconds(thread) if thread is not None else 0.0
        self.record = record
        self.rid = record.id if record is not None else None  # its ring slot may be reused
        self.failure = failure
        self.report = report

    def is_ready(self) -> bool:
        if self.failed:
            return True
        array = self.array
        return array is not None and (array.is_deleted() or array.is_ready())

    def due(self, now: float) -> bool:
        """Whether the deadline passed, not counting the dispatching thread's compile time."""
        if self.thread is None:
            return now >= self.deadline
        if compile_clock.compiling(self.thread):
            return False
        return now >= self.deadline + compile_clock.seconds(self.thread) - self.compiled


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

    def watch(self, deadline: float, describe: Callable[[], Any], **kw: Any) -> Outstanding:
        entry = Outstanding(deadline, describe, **kw)
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
                self._finished(entry)
                continue
            if not entry.due(time.monotonic()):
                if entry.report is not None:
                    entry.report()
                return
            pending.popleft()
            if self._fire(entry):
                return  # re-armed: a peer still compiles the call

    def _finished(self, entry: Outstanding) -> None:
        """Marks the record of a collective whose output is ready; fires if it failed."""
        if entry.failed or entry.array is None:
            return
        if entry.array.is_deleted():  # donated to a later program (a train step's state):
            if entry.record is not None:  # that program is watched in its turn
                entry.record.complete(entry.rid)
            return
        try:
            entry.array.block_until_ready()  # ready: returns at once, or raises XLA's error
        except Exception as err:  # noqa: BLE001 (a collective that failed in XLA)
            if entry.record is not None:
                entry.record.fail("failed", str(err), entry.rid)
            if entry.failure is not None:
                self._fire(entry, kind="DistNetworkError", text=entry.failure(str(err)))
            return
        if entry.record is not None:
            entry.record.complete(entry.rid)

    def _fire(self, entry: Outstanding, kind: str = "DistTimeoutError",
              text: str | None = None) -> bool:
        """Reports the entry's timeout (or ``text``) and ends the process; returns True
        instead when a peer still compiles the call (the entry is watched again)."""
        if text is None:
            try:
                described = entry.describe()
            except Exception as err:  # noqa: BLE001 (say what we know, then still tear down)
                described = f"a collective timed out (its description failed: {err!r})"
            text, extend = described if isinstance(described, tuple) else (described, False)
            if extend:  # a peer still compiles this call: not a hang yet
                entry.deadline = time.monotonic() + entry.span
                self._pending.appendleft(entry)
                return True
            if entry.record is not None:
                entry.record.fail("timed out", text, entry.rid)
        tear_down = _tears_down()
        print(f"[jaxpg watchdog] {kind}: {text}"
              + (" Ending the process (JAXPG_ASYNC_ERROR_HANDLING=0 keeps it running; "
                 "JAXPG_BLOCKING_WAIT=1 raises in the caller instead)." if tear_down else ""),
              file=sys.stderr, flush=True)
        for hook in _teardown_hooks:
            try:
                hook(f"{kind}: {text}")
            except Exception:  # noqa: BLE001
                pass
        if tear_down:
            os._exit(WATCHDOG_EXIT_CODE)
        self.fired = text  # last: a test that waits for it has seen the whole firing
        return False


_watchdog = _Watchdog()


def watch(deadline: float, describe: Callable[[], Any], **kw: Any) -> Outstanding:
    """Watches one collective about to be dispatched: set the returned entry's ``array``
    (one of its outputs) after the dispatch, or ``failed`` if it raised. Unless that array
    is ready by ``deadline`` (``time.monotonic()``), the watchdog prints ``describe()`` and
    ends the process. Keywords: ``thread``, ``record``, ``failure`` and ``report`` of
    ``Outstanding``."""
    return _watchdog.watch(deadline, describe, **kw)


def forget() -> None:
    """Stops watching everything outstanding (``destroy_process_group``)."""
    _watchdog.forget()
