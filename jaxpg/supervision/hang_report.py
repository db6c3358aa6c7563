"""Lines that say what a waiting collective waits for, long before its timeout.

A rank whose peer never arrives waits the group's timeout (30 minutes by default) before
the ``DistTimeoutError`` names the peer. Meanwhile, every ``JAXPG_HANG_REPORT_SECONDS``
seconds (default 60; ``0`` turns the lines off) that a collective or a recorded step has
waited (its compile time not counted), the waiting rank prints to stderr what the timeout
would say now, from the same diagnosis (``jaxpg.supervision.hang_diagnosis``: the peers'
answers through the flight recorder's requests, their published progress, and liveness)::

    [jaxpg hang] rank 0: all_reduce #5 on group 'WORLD' has waited 60.0 s (timeout
    1800.0 s): rank 1 never started it (its last call: barrier #4, finished at
    train.py:52); ranks that did not arrive: [1].

The line names the op, the group, the call's sequence number, the ranks that have not
arrived and each one's last call. The call goes on waiting; the timeout's error is
unchanged.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, NamedTuple

from jaxpg.supervision import compile_clock, hang_diagnosis

__all__ = ["ENV", "DEFAULT_SECONDS", "interval", "Call", "Reporter", "line"]

ENV = "JAXPG_HANG_REPORT_SECONDS"
DEFAULT_SECONDS = 60.0


def interval() -> float | None:
    """``JAXPG_HANG_REPORT_SECONDS`` (seconds between two lines); None when off (``0``).

    Raises:
        ValueError: for a value that is not a number of seconds.
    """
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r} is not a number of seconds; set it to e.g. 60, or "
                         "0 to turn the hang lines off.") from None
    if seconds < 0 or seconds != seconds:
        raise ValueError(f"{ENV}={raw!r} must be >= 0 (0 turns the hang lines off).")
    return seconds or None


def line(group: Any, api: str, seq: int, waited: float, timeout: float | None) -> str:
    """The line for call ``api`` #``seq`` on ``group`` that has waited ``waited`` seconds."""
    state = group._world
    text = hang_diagnosis.diagnose(group, api, seq, waited, waiting=True).text
    if timeout is not None:
        head = f" has waited {waited:.1f} s"
        text = text.replace(head, f"{head} (timeout {timeout:.1f} s)", 1)
    return f"[jaxpg hang] rank {state.acting_rank()}: {text}"


class Call(NamedTuple):
    """The call a :class:`Reporter` reports on, where no runner ``Job`` holds it (a
    stream-ordered collective under the watchdog)."""

    group: Any
    api: str
    seq: int


class Reporter:
    """Prints :func:`line` each time a waiting call has waited another ``interval()``
    seconds; :meth:`poll` is called from the waiting loop (``wait_job``, or the watchdog's
    thread for a stream-ordered collective)."""

    __slots__ = ("every", "timeout", "thread", "start", "base", "next")

    def __init__(self, thread: int | None, timeout: float | None) -> None:
        self.every = interval()
        self.timeout = timeout
        self.thread = thread  # the dispatching thread, whose compile time does not count
        self.start = time.monotonic()
        self.base = compile_clock.seconds(thread) if thread is not None else 0.0
        self.next = self.every

    def poll(self, job: Any) -> None:
        """Prints the line if it is due; ``job`` (a runner ``Job`` or a :class:`Call`) holds
        the call (group, api, seq) waited on."""
        if self.every is None or job is None or job.group is None:
            return
        thread = self.thread
        if thread is not None and compile_clock.compiling(thread):
            return
        compiled = compile_clock.seconds(thread) - self.base if thread is not None else 0.0
        waited = time.monotonic() - self.start - compiled
        if waited < self.next:
            return
        self.next = waited + self.every
        try:
            text = line(job.group, job.api, job.seq, waited, self.timeout)
        except Exception as err:  # noqa: BLE001 (a report never breaks the wait)
            text = (f"[jaxpg hang] {job.api} #{job.seq} on group {job.group.group_name!r} has "
                    f"waited {waited:.1f} s (its diagnosis failed: {err!r})")
        print(text, file=sys.stderr, flush=True)
