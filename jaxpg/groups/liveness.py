"""Which processes of the world the coordination service lost, watched in the background.

JAX's coordination service tracks every process by its heartbeats (and by the long-running
RPC each keeps open, which breaks at once when a process dies). One daemon thread per
process asks it every ``_PERIOD`` seconds which processes are alive
(``get_live_nodes``). A process that is gone is *lost*: the collective this process waits
in, or its next one, among the lost process's ranks raises ``DistNetworkError`` naming
them (:func:`check`, called by ``jaxpg.groups.multiprocess``), within the heartbeat timeout
of the death (at once for a process that exited or was killed; after the heartbeat timeout
for one that hangs or is stopped).

When rank 0 hosts the service in its child process (:mod:`jaxpg.coordinator_process`) and
rank 0 is lost, the child serves only a while longer; this process then shuts its client
down at once (as torch aborts a communicator), so the service's later end cannot end this
process with JAX's C++ fatal error. Before that it notes ``jaxpg_aborted/<process>`` in the
store, so the other survivors do not count it as lost as well.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from jaxpg.errors import DistNetworkError

__all__ = ["start", "stop", "lost", "check", "wait_lost", "naming_lost"]

_PERIOD = 0.25
_ABORTED = "jaxpg_aborted/"


class _Monitor:
    def __init__(self, client: Any, num_processes: int, me: int, abort_on_lost_zero: bool):
        self._client = client
        self._all = list(range(num_processes))
        self._me = me
        self._abort = abort_on_lost_zero
        self._stop = threading.Event()
        self.lost: list[int] = []
        self.aborted = False
        self._thread = threading.Thread(target=self._loop, name="jaxpg-liveness", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(_PERIOD):
            try:
                live = set(self._client.get_live_nodes(self._all))
            except Exception:  # noqa: BLE001 (service unreachable: a collective shows it)
                continue
            missing = [p for p in self._all if p not in live and p != self._me]
            if not missing or self._stop.is_set():
                continue
            try:  # survivors that detached after losing rank 0 are not lost themselves
                aborted = {int(k.rpartition("/")[2])
                           for k, _ in self._client.key_value_dir_get(_ABORTED)}
            except Exception:  # noqa: BLE001
                aborted = set()
            gone = [p for p in missing if p not in aborted]
            if gone:
                self.lost = sorted(set(self.lost) | set(gone))
            if self._abort and 0 in self.lost:
                self._detach()
                return

    def _detach(self) -> None:
        from jax._src import distributed

        try:
            self._client.key_value_set(f"{_ABORTED}{self._me}", ",".join(map(str, self.lost)))
        except Exception:  # noqa: BLE001
            pass
        self.aborted = True
        try:
            distributed.global_state.shutdown()
        except Exception:  # noqa: BLE001 (detaching from a dying service: nothing to do)
            pass


_monitor: _Monitor | None = None


def start(client: Any, num_processes: int, me: int, abort_on_lost_zero: bool) -> None:
    """Starts watching the world's processes (``init_process_group``)."""
    global _monitor
    stop()
    if num_processes > 1:
        _monitor = _Monitor(client, num_processes, me, abort_on_lost_zero)


def stop() -> None:
    """Stops watching (``destroy_process_group``, before the processes leave)."""
    global _monitor
    if _monitor is not None:
        _monitor.stop()
        _monitor = None


def lost() -> list[int]:
    """The processes found lost so far (empty when none, or when nothing is watched)."""
    return [] if _monitor is None else list(_monitor.lost)


def wait_lost(procs: Sequence[int], seconds: float) -> list[int]:
    """The lost processes among ``procs``, waiting up to ``seconds`` for one to show (a
    collective failed: if a peer died, the service notices within the heartbeat timeout)."""
    if _monitor is None:
        return []
    deadline = time.monotonic() + seconds
    wanted = set(procs)
    while True:
        gone = [p for p in _monitor.lost if p in wanted]
        if gone or time.monotonic() >= deadline:
            return gone
        time.sleep(0.05)


def check(procs: Sequence[int], ranks_of: Any, what: str) -> None:
    """Raises ``DistNetworkError`` if any of ``procs`` is lost.

    Args:
        procs: the processes ``what`` needs.
        ranks_of: maps a list of processes to the ranks they hold (for the message).
        what: the call, for the message (e.g. "all_reduce on group 'WORLD' (sequence
            number 3)").
    """
    if _monitor is None or not _monitor.lost:
        return
    gone = [p for p in _monitor.lost if p in set(procs)]
    if not gone:
        return
    detached = (" This process detached from the coordination service (rank 0 hosted it); "
                "call destroy_process_group and start a new world to go on."
                if _monitor.aborted else "")
    raise DistNetworkError(
        f"{what}: lost ranks {ranks_of(gone)} (processes {gone}): the coordination service "
        f"stopped hearing from them (they died, exited or hang).{detached}"
    )


@contextlib.contextmanager
def naming_lost(what: str, heartbeat_timeout: float) -> Iterator[None]:
    """Turns a failure inside the block (e.g. orbax's barriers on the coordination service)
    into ``DistNetworkError`` naming the lost processes, when a peer was lost (waits up to
    ``heartbeat_timeout`` + 1 s for the service to notice); other failures pass unchanged."""
    try:
        yield
    except DistNetworkError:
        raise
    except Exception as err:
        if _monitor is None:
            raise
        gone = wait_lost(_monitor._all, heartbeat_timeout + 1.0)
        if not gone:
            raise
        raise DistNetworkError(
            f"{what} failed: {err}; lost processes {gone}: the coordination service stopped "
            "hearing from them (they died, exited or hang)."
        ) from err
