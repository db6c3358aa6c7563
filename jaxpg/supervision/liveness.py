"""Which processes of the world the coordination service lost, watched in the background.

JAX's coordination service tracks every process by its heartbeats (and by the long-running
RPC each keeps open, which breaks at once when a process dies). One daemon thread per
process asks it every ``_PERIOD`` seconds which processes are alive
(``get_live_nodes``). A process that is gone is *lost*: the collective this process waits
in, or its next one, among the lost process's ranks raises ``DistNetworkError`` naming
them (:func:`check`, called by ``jaxpg.groups.multiprocess``), within the heartbeat timeout
of the death (at once for a process that exited or was killed; after the heartbeat timeout
for one that hangs or is stopped).

When rank 0 hosts the service in its child process (:mod:`jaxpg.runtime.coordinator_process`) and
rank 0 is lost, the child serves only a while longer; this process then shuts its client
down at once (as torch aborts a communicator), so the service's later end cannot end this
process with JAX's C++ fatal error. Before that it notes ``jaxpg_aborted/<process>`` in the
store, so the other survivors do not count it as lost as well.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from jaxpg.errors import DistNetworkError

__all__ = ["start", "stop", "lost", "left", "check", "check_any", "wait_lost", "naming_lost",
           "mark_reported", "before_teardown"]

_PERIOD = 0.25
_ABORTED = "jaxpg_aborted/"
_LEFT = "jaxpg_left/"
TEARDOWN_EXIT_CODE = 1
_teardown_hooks: list[Any] = []  # called with the error's text before a teardown


def before_teardown(hook: Any) -> None:
    """Registers ``hook(text)``, called before this module ends the process."""
    if hook not in _teardown_hooks:
        _teardown_hooks.append(hook)


class _Monitor:
    def __init__(self, client: Any, num_processes: int, me: int, abort_on_lost_zero: bool,
                 grace_s: float, ranks_of: Any = None):
        self._client = client
        self.ranks_of = ranks_of or (lambda procs: list(procs))
        self._all = list(range(num_processes))
        self._me = me
        self._abort = abort_on_lost_zero
        self._grace = grace_s
        self._stop = threading.Event()
        self.lost: list[int] = []
        self.aborted = False
        self.reported = False  # a jaxpg call raised the loss to the program
        self._found_at: float | None = None
        self._thread = threading.Thread(target=self._loop, name="jaxpg-liveness", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(_PERIOD):
            if not self.aborted:
                self._poll()
            if (self._found_at is not None and not self.reported and not self._stop.is_set()
                    and time.monotonic() - self._found_at > self._grace and _tears_down()):
                self._tear_down()

    def _poll(self) -> None:
        try:
            live = set(self._client.get_live_nodes(self._all))
        except Exception:  # noqa: BLE001 (service unreachable: a collective shows it)
            return
        missing = [p for p in self._all if p not in live and p != self._me]
        if not missing or self._stop.is_set():
            return
        try:  # processes that left cleanly, or detached after losing rank 0, are not lost
            gone_ok = {int(k.rpartition("/")[2]) for prefix in (_ABORTED, _LEFT)
                       for k, _ in self._client.key_value_dir_get(prefix)}
        except Exception:  # noqa: BLE001
            gone_ok = set()
        gone = [p for p in missing if p not in gone_ok]
        if gone:
            self.lost = sorted(set(self.lost) | set(gone))
            if self._found_at is None:
                self._found_at = time.monotonic()
        if self._abort and 0 in self.lost:
            self._detach()

    def _detach(self) -> None:
        from jaxpg._jax_compat import distributed_state

        try:
            self._client.key_value_set(f"{_ABORTED}{self._me}", ",".join(map(str, self.lost)))
        except Exception:  # noqa: BLE001
            pass
        self.aborted = True
        try:
            distributed_state().shutdown()
        except Exception:  # noqa: BLE001 (detaching from a dying service: nothing to do)
            pass

    def _tear_down(self) -> None:
        """No jaxpg call told the program of the loss within the grace (it waits in a
        jitted collective, which nothing can interrupt): end the process, as torch's
        watchdog does."""
        text = (f"lost ranks {self.ranks_of(self.lost)} (processes {self.lost}): the "
                "coordination service stopped hearing from them, and no jaxpg call of this "
                f"process raised it within {self._grace:.1f} s (it waits in a jitted collective "
                "or does not call jaxpg)")
        print(f"[jaxpg liveness] DistNetworkError: {text}. Ending the process "
              "(JAXPG_ASYNC_ERROR_HANDLING=0 keeps it running).", file=sys.stderr, flush=True)
        for hook in _teardown_hooks:
            try:
                hook(f"DistNetworkError: {text}")
            except Exception:  # noqa: BLE001
                pass
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001
            pass
        os._exit(TEARDOWN_EXIT_CODE)


def _tears_down() -> bool:
    value = os.environ.get("JAXPG_ASYNC_ERROR_HANDLING",
                           os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"))
    return value.strip() != "0"


_monitor: _Monitor | None = None


def start(client: Any, num_processes: int, me: int, abort_on_lost_zero: bool,
          grace_s: float, ranks_of: Any = None) -> None:
    """Starts watching the world's processes (``init_process_group``).

    Args:
        client: the coordination-service client.
        num_processes: the world's processes.
        me: this process.
        abort_on_lost_zero: detach the client once process 0 is lost (its child hosts the
            service, which ends a while after it).
        grace_s: after a loss no jaxpg call raised within this many seconds (the world's
            timeout), the process ends with the error's text.
        ranks_of: maps a list of processes to the world ranks they hold (for messages);
            the processes themselves when ``None`` (one rank per process).
    """
    global _monitor, _registered
    stop()
    from jaxpg.stores import tcp_store

    tcp_store.add_wait_check(check_any)  # a TCPStore read waiting on a lost rank names it
    if num_processes > 1:
        _monitor = _Monitor(client, num_processes, me, abort_on_lost_zero, grace_s, ranks_of)
        if not _registered:
            atexit.register(_leave_at_exit)
            sys.excepthook = _failing_exit(sys.excepthook)
            _registered = True


def stop(leaving: bool = False) -> None:
    """Stops watching (``destroy_process_group``, before the processes leave); with
    ``leaving``, tells the others this process leaves cleanly (not lost)."""
    global _monitor
    monitor, _monitor = _monitor, None
    if monitor is None:
        return
    monitor.stop()
    if threading.current_thread() is not monitor._thread:
        # out of its RPC before the interpreter ends: a daemon thread woken inside C++
        # during finalization aborts the process ("FATAL: exception not rethrown"); an RPC
        # of a loaded machine can take seconds
        monitor._thread.join(timeout=10.0)
    if leaving and not monitor.aborted:
        try:
            monitor._client.key_value_set(f"{_LEFT}{monitor._me}", "1")
        except Exception:  # noqa: BLE001
            pass


_registered = False


def _failing_exit(previous: Any) -> Any:
    """An ``excepthook`` that, in a watched world, ends a process whose script raised at once
    after the traceback and the ``atexit`` handlers, with exit code 1.

    Its peers name it as lost as soon as its client disconnects, and without this they could
    exit with their own error while it still tears the interpreter down, so a launcher
    would report them first; ``os._exit`` also skips the finalization during which a
    collective thread stuck in XLA could wake and abort in C++.
    """

    def hook(kind: type, value: BaseException, tb: Any) -> None:
        previous(kind, value, tb)
        if _monitor is None or not issubclass(kind, Exception):
            return
        sys.last_value = value  # what _leave_at_exit reads: a failure, not a clean end
        try:
            atexit._run_exitfuncs()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001
                    pass
            os._exit(1)

    return hook


def _leave_at_exit() -> None:
    """The interpreter ends without ``destroy_process_group``: a clean end is no loss to the
    others; an uncaught exception is (the others name this process)."""
    stop(leaving=getattr(sys, "last_value", None) is None)


def lost() -> list[int]:
    """The processes found lost so far (empty when none, or when nothing is watched)."""
    return [] if _monitor is None else list(_monitor.lost)


def left() -> list[int]:
    """The processes that left the world cleanly (asks the service: one RPC)."""
    if _monitor is None:
        return []
    try:
        return sorted({int(k.rpartition("/")[2])
                       for k, _ in _monitor._client.key_value_dir_get(_LEFT)})
    except Exception:  # noqa: BLE001
        return []


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


def mark_reported() -> None:
    """A jaxpg call raised the loss to the program (no teardown needed)."""
    if _monitor is not None:
        _monitor.reported = True


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
    _monitor.reported = True
    detached = (" This process detached from the coordination service (rank 0 hosted it); "
                "call destroy_process_group and start a new world to go on."
                if _monitor.aborted else "")
    raise DistNetworkError(
        f"{what}: lost ranks {ranks_of(gone)} (processes {gone}): the coordination service "
        f"stopped hearing from them (they died, exited or hang).{detached}"
    )


def check_any(what: str) -> None:
    """Raises ``DistNetworkError`` if any process of the world is lost (a store read that
    waits for a key: the key may be due from the lost process, so it may never come).

    Args:
        what: the call, for the message (e.g. "TCPStore.get('ready')").
    """
    if _monitor is None or not _monitor.lost:
        return
    gone = list(_monitor.lost)
    _monitor.reported = True
    raise DistNetworkError(
        f"{what}: lost ranks {_monitor.ranks_of(gone)} (processes {gone}) while waiting: the "
        "coordination service stopped hearing from them (they died, exited or hang), so the "
        "key may never be set. Call destroy_process_group and start a new world to go on."
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
        _monitor.reported = True
        raise DistNetworkError(
            f"{what} failed: {err}; lost processes {gone}: the coordination service stopped "
            "hearing from them (they died, exited or hang)."
        ) from err
