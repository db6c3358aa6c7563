"""Where a process-executor step's time goes: each action's compute, each transfer, the waits.

``with record_timeline() as tl:`` around steps of the process executor
(``jaxpg.pipeline.process.executor``) records, in this process:

* ``"wait"``: the host thread waiting for a message an action reads (the action cannot
  be queued before it arrives);
* ``"compute"``: each action, from when the device could start it (queued, inputs there,
  the previous action done) to when its outputs were ready, seen by a watcher thread
  that waits for each action's outputs in order;
* ``"send"`` / ``"recv"``: each transfer on a lane, from when the lane entered the
  collective (its data ready) to its end: the transfer itself, plus the wait for the
  peer to enter it.

:func:`summarize` turns the events into per-step totals: compute, the rank's idle time
(``step - compute``), the host's waits, and the lanes' transfer time (which overlaps the
compute). Times are ``time.perf_counter()`` seconds of this process.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax

__all__ = ["Event", "Timeline", "record_timeline", "recording", "summarize"]


class Event(NamedTuple):
    """One span: ``kind`` (``"wait"``, ``"compute"``, ``"send"``, ``"recv"``, ``"step"``),
    a label (``"F3"``, ``"act 2 3"``, ...), start and end in ``perf_counter`` seconds."""

    kind: str
    label: str
    start: float
    end: float


class Timeline:
    """The events of the steps run while recording; thread-safe appends."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._last_end = 0.0
        self._thread = threading.Thread(target=self._watch, name="jaxpg-timeline",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def add(self, kind: str, label: str, start: float, end: float) -> None:
        with self._lock:
            self.events.append(Event(kind, label, start, end))

    def action(self, label: str, queued: float, outputs: Any) -> None:
        """An action was queued at ``queued``; its compute ends when ``outputs`` are ready
        (or, for a ``concurrent.futures.Future``, at the time it resolves to: an action whose
        only outputs the next one donates, which the host waits for itself)."""
        self._queue.put((label, queued, outputs))

    def flush(self) -> None:
        """Waits until every queued action's end is recorded."""
        done = threading.Event()
        self._queue.put(done)
        done.wait()

    def _watch(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            if item is None:
                return
            label, queued, outputs = item
            try:
                if isinstance(outputs, concurrent.futures.Future):
                    end = outputs.result()
                else:
                    jax.block_until_ready(outputs)
                    end = time.perf_counter()
            except Exception:  # noqa: BLE001 (a failed step: its actions end now)
                end = time.perf_counter()
            start = max(queued, self._last_end)
            self._last_end = end
            self.add("compute", label, start, end)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)


_current: Timeline | None = None


def recording() -> Timeline | None:
    """The timeline being recorded, or None."""
    return _current


@contextlib.contextmanager
def record_timeline() -> Iterator[Timeline]:
    """Records the process executor's steps in this process (see the module docstring)."""
    global _current
    tl = Timeline()
    _current = tl
    try:
        yield tl
    finally:
        _current = None
        tl.close()


def summarize(events: list[Event]) -> list[dict[str, float]]:
    """Per step (``"step"`` events): wall, compute, idle, host wait and transfer seconds.

    ``idle`` is the step's wall time less its compute: the rank's bubble, its waits for
    messages and the host's own overhead together. ``transfer`` sums the lanes' spans,
    which overlap the compute and each other.
    """
    out = []
    for step in (e for e in events if e.kind == "step"):
        inside = [e for e in events if e.kind != "step" and step.start <= e.start < step.end]

        def total(*kinds: str, inside: list[Event] = inside) -> float:
            return sum(e.end - e.start for e in inside if e.kind in kinds)

        wall = step.end - step.start
        compute = total("compute")
        out.append({"wall": wall, "compute": compute, "idle": wall - compute,
                    "host_wait": total("wait"), "transfer": total("send", "recv"),
                    "actions": float(sum(e.kind == "compute" for e in inside))})  # fmt: skip
    return out
