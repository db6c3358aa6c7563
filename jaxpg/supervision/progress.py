"""Progress records: how far this process got in each group, published in the background.

Every eager collective of a multi-process run notes its sequence number and fingerprint
here. The background thread raises the group's counter ``progress/<process>`` (an ``add``:
one RPC, no lock) at most once per group every ``_PERIOD`` seconds, so a loop of many small
collectives costs a few RPCs a second; once a group's number has stayed the same for a
period (the process waits in that collective, or has stopped calling them) it also writes
the fingerprint's text to ``running/<process>``, for a peer's timeout message. A process
stuck in a collective has published both long before a peer's timeout reads them.
"""

from __future__ import annotations

import atexit
import collections
import threading
import time
from typing import Any

from jaxpg.supervision.desync import fingerprint_text

__all__ = ["progress"]


class _Progress:
    """Publishes each group's highest sequence number this process reached, in the background.

    ``note`` only records the number (and the collective's fingerprint) and wakes the
    thread. The thread raises the group's counter ``progress/<process>`` (``add`` of the
    difference: one RPC, no lock) and then rests ``_PERIOD`` seconds, so a loop of many
    small collectives costs a few RPCs a second instead of one each. Once a group's number
    has stayed the same for a period (the process waits in that collective, or has stopped
    calling them), it also writes what the process is running, the fingerprint's text, to
    ``running/<process>`` (a locked ``set``: three RPCs), for a peer's timeout message. A
    process stuck in a collective has published both long before a peer's timeout reads
    them; ``publish_now`` writes this process's at once.
    """

    _PERIOD = 0.02

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # group -> [reached, published, (seq, fingerprint) of reached, seq whose text is out]
        self._latest: dict[Any, list[Any]] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._discards: collections.deque = collections.deque()
        self._registered = False

    def note(self, group: Any, seq: int, fingerprint: Any = None) -> None:
        entry = self._latest.get(group)
        if entry is None:
            with self._lock:
                entry = self._latest.setdefault(group, [0, 0, (0, None), 0])
                if self._thread is None:
                    self._stopping = threading.Event()
                    self._thread = threading.Thread(target=self._loop, args=(self._stopping,),
                                                    name="jaxpg-progress", daemon=True)
                    self._thread.start()
                    if not self._registered:
                        # Out of its RPCs before the interpreter ends: a daemon thread
                        # inside the store client then aborts the process (std::terminate).
                        atexit.register(self.stop)
                        self._registered = True
        if seq > entry[0]:
            entry[2] = (seq, fingerprint)
            entry[0] = seq
        self._wake.set()

    def publish_now(self, group: Any | None = None, texts: bool = True) -> None:
        """Writes the counters that moved; with ``texts``, the running text of every group
        whose counter did not move since the last write (or of ``group``, at once)."""
        counts, running = [], []
        with self._lock:
            for g, e in self._latest.items():
                if group is not None and g is not group:
                    continue
                moved = e[0] > e[1]
                if moved:
                    counts.append((g, e[0] - e[1]))
                    e[1] = e[0]
                seq, fp = e[2]
                if texts and e[3] != seq and (group is not None or not moved):
                    running.append((g, seq, fp))
                    e[3] = seq
        for g, seq, fp in running:  # before the count: a peer that sees it sees the text
            try:
                g.store.set(f"running/{g._world.process_index}",
                            fingerprint_text(g.group_name, seq, fp))
            except Exception:  # noqa: BLE001 (a lost store shows in the collective itself)
                pass
        for g, delta in counts:
            try:
                g.store.add(f"progress/{g._world.process_index}", delta)
            except Exception:  # noqa: BLE001
                pass

    def _settled(self) -> bool:
        return all(e[3] == e[2][0] for e in self._latest.values())

    def discard(self, group: Any, key: str) -> None:
        """Deletes ``key`` from the group's store in the background."""
        self._discards.append((group, key))
        self._wake.set()

    def forget(self) -> None:
        """Stops the thread and drops every record (the world ends)."""
        self.stop()
        with self._lock:
            self._latest.clear()
            self._discards.clear()

    def stop(self, timeout: float = 5.0) -> None:
        """Stops the background thread after its current write (at exit, or as the world ends)."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._stopping.set()
        if thread is not None:
            self._wake.set()
            thread.join(timeout)

    def _loop(self, stopping: threading.Event) -> None:
        while not stopping.is_set():
            self._wake.wait(None if self._settled() else self._PERIOD)
            self._wake.clear()
            if stopping.is_set():
                return
            self.publish_now()
            while self._discards:
                group, key = self._discards.popleft()
                try:
                    group.store.delete_key(key)
                except Exception:  # noqa: BLE001 (cleanup only)
                    pass
            time.sleep(self._PERIOD)


progress = _Progress()
