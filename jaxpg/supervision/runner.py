"""The runner: one daemon thread that dispatches eager collectives, so callers can stop
waiting.

On CPU, XLA runs a collective on the dispatching thread when it counts it cheap (under 1000
flops: a small all_reduce; all_gather, all_to_all and ppermute, which have no flops, at any
size), so a peer that never arrives would block the caller forever. Blocking collectives and
every ``async_op=True`` collective of a multi-process run are queued here as ``Job``s and run
in the order they were called; the caller waits with a timeout, or not at all
(``async_op``). A thread left stuck in a dead collective is abandoned (a daemon does not
keep the process alive) and a fresh one, with a fresh queue, serves later calls.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Job", "Runner", "runner"]


class Job:
    """A call queued on the runner: a light Future (one pre-acquired lock, released when
    done) that also says which collective it ran last (group, op, sequence number), so a
    timeout can name the missing ranks."""

    __slots__ = ("_lock", "_result", "_error", "finished", "group", "api", "seq", "thread",
                 "caller")

    def __init__(self, api: str) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._result: Any = None
        self._error: BaseException | None = None
        self.finished = False
        self.group: Any = None
        self.api = api
        self.seq = 0
        self.thread: int | None = None  # the runner thread's ident (its compile time)
        self.caller: Any = None  # the user's frame that queued it (flight recorder)

    def done(self) -> bool:
        return self.finished

    def _finish(self, result: Any, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self.finished = True
        self._lock.release()

    def result(self, timeout: float | None = None) -> Any:
        """The job's result (or its error); ``concurrent.futures.TimeoutError`` after
        ``timeout`` seconds."""
        if not self.finished:
            if not self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
                raise concurrent.futures.TimeoutError
            self._lock.release()
        if self._error is not None:
            raise self._error
        return self._result


class _Worker:
    """One runner thread with its own queue and counters (an abandoned one keeps them)."""

    def __init__(self, local: threading.local) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.current: Job | None = None
        self.submitted = 0  # written by callers only
        self.finished = 0  # written by this worker's thread only
        self._local = local
        thread = threading.Thread(target=self._loop, name="jaxpg-collective", daemon=True)
        thread.start()
        self.ident = thread.ident

    def _loop(self) -> None:
        self._local.worker = self
        while True:
            fn, job = self.jobs.get()
            self.current = job
            try:
                result, error = fn(), None
            except BaseException as exc:  # noqa: BLE001 (handed to the caller)
                result, error = None, exc
            self.current = None
            self.finished += 1
            job._finish(result, error)


class _Runner:
    """A queue of calls run in order on one daemon thread (see the module docstring).

    ``runner`` is the one every eager collective uses; other parts of jaxpg make their own
    (``Runner()``: the pipeline's point-to-point lanes, one per peer) so that their calls
    neither wait behind the collectives nor hold them up. A stuck thread of any runner is
    handled at exit as the eager collectives' is.
    """

    def __init__(self) -> None:
        self._worker: _Worker | None = None
        self._local = threading.local()
        self._abandoned: list[_Worker] = []
        _all_runners.append(self)

    @property
    def current(self) -> Job | None:
        """The job running now (None when idle or on no worker)."""
        return None if self._worker is None else self._worker.current

    def on_runner(self) -> bool:
        """True on a runner thread (a collective inside a queued job runs in place)."""
        return getattr(self._local, "worker", None) is not None

    def running_job(self) -> Job | None:
        """On a runner thread, the job it runs; else None."""
        worker = getattr(self._local, "worker", None)
        return None if worker is None else worker.current

    def idle(self) -> bool:
        """True when no job is queued or running."""
        worker = self._worker
        return worker is None or worker.submitted == worker.finished

    def submit(self, fn: Callable[[], Any], api: str, caller: Any = None) -> Job:
        """Queues ``fn`` and returns its Job at once (``caller``: the user's frame, for the
        flight recorder)."""
        if self._worker is None:
            self._worker = _Worker(self._local)
        job = Job(api)
        job.thread, job.caller = self._worker.ident, caller
        self._worker.submitted += 1
        self._worker.jobs.put((fn, job))
        return job

    def abandon(self) -> None:
        """Leaves the current thread to its stuck job; the next ``submit`` starts another.
        Jobs still queued behind the stuck one never run (their waits time out)."""
        if self._worker is not None:
            self._abandoned.append(self._worker)
            _record_exit_codes()
        self._worker = None

    def stuck(self) -> bool:
        """Whether an abandoned thread is still inside its job (in XLA's C++, likely)."""
        return any(w.current is not None for w in self._abandoned)


_all_runners: list[_Runner] = []
Runner = _Runner
runner = _Runner()


_exit_code: list[int] = []  # what sys.exit was called with, once a thread was abandoned


def _record_exit_codes() -> None:
    """Wraps ``sys.exit`` (once) so that ``_exit_past_stuck_collectives`` can end the
    process with the status the program asked for (None 0, an int itself, anything else
    1: the interpreter has printed it by then)."""
    if getattr(sys.exit, "_jaxpg_records", False):
        return
    plain_exit = sys.exit

    def exit(code: Any = None) -> None:  # noqa: A001 (stands in for sys.exit)
        status = 0 if code is None else code & 0xFF if isinstance(code, int) else 1
        _exit_code[:] = [status]
        plain_exit(code)

    exit._jaxpg_records = True  # type: ignore[attr-defined]
    sys.exit = exit


def _exit_past_stuck_collectives() -> None:
    """At exit, with a collective thread still stuck in XLA (a peer died): end the process
    here, with 1 after an uncaught exception (its traceback is printed already), with the
    status ``sys.exit`` was given, and 0 otherwise.

    Python 3.11 ends a daemon thread that wakes during finalization with a forced unwind,
    which aborts the process in C++ ("FATAL: exception not rethrown") when the thread
    wakes inside XLA's frames: a stuck collective does wake, once another survivor exits
    and closes its gloo connection. Registered at import, so it runs after every
    ``atexit`` handler registered later. ``sys.exit`` is wrapped once a collective thread
    is abandoned, to know its status here (``raise SystemExit(n)`` itself is not seen:
    such a process exits with 0).
    """
    if not any(r.stuck() for r in _all_runners):
        return
    if getattr(sys, "last_value", None) is not None:
        code = 1
    else:
        code = _exit_code[0] if _exit_code else 0
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


atexit.register(_exit_past_stuck_collectives)
