"""Joining JAX's coordination service within a deadline: a named Python error, never an abort.

``init_process_group`` connects every process to the coordination service, whose
``RegisterTask`` waits until all processes registered. When one never comes, JAX's client
ends the process with a C++ fatal error (``client.h:80] Terminating process ...
DEADLINE_EXCEEDED ... RegisterTask``): no exception, no rank named. :func:`connect` joins
instead so that the failure is a :class:`~jaxpg.errors.DistTimeoutError` raised within the
timeout, as torch's store-based barrier raises one:

* **the coordinator never listens**: a process that does not host the service first waits
  (a plain TCP connect, every 0.1 s, until the deadline) for the coordinator's port; if
  nothing listens by then, the error names the address and rank 0 (its host), and the
  connect is never tried;
* **a process never joins**: the client is made so that a failed connect raises in Python
  (``_jax_compat.joining_client``), and the service that rank 0 hosts gives up on the
  registration at the same deadline (``cluster_register_timeout``); the service's answer
  says how many processes joined and which did not, which the error repeats. Where the
  service cannot say (the launcher hosts it, or rank 0 started late), a *lobby* names them:
  the rendezvous store's rank claims (``file://``, ``store=``) or ``jaxpg-run``'s lobby
  folder (one empty file per rank that reached ``init_process_group``).

What JAX's C++ code logs on stderr while connecting (retries, the barrier's failure) is
collected, read for those facts and dropped; ``JAXPG_DEBUG`` (any value) shows it.
"""

from __future__ import annotations

import math
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from jaxpg import _jax_compat
from jaxpg.errors import DistBackendError, DistTimeoutError

__all__ = ["LOBBY_VAR", "check_port_free", "connect", "lobby_arrivals", "note_arrival",
           "show_cpp_logs", "wait_until_listening"]

LOBBY_VAR = "JAXPG_RUN_LOBBY"
"""The folder where ``jaxpg-run``'s workers note that they reached ``init_process_group``."""

_POLL_S = 0.1
_ABSL_LINE = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [\w./+-]+:\d+\] ", re.M)


def show_cpp_logs() -> bool:
    """Whether JAX's C++ log lines are shown (``JAXPG_DEBUG`` is set to anything)."""
    return bool(os.environ.get("JAXPG_DEBUG", "").strip())


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def wait_until_listening(address: str, deadline: float) -> bool:
    """Waits until something accepts TCP connections at ``address`` or ``deadline``
    (``time.monotonic()``) passes; True if it did."""
    host, port = _split(address)
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.05, min(1.0, left))):
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))


def check_port_free(bind_address: str) -> None:
    """Raises ``OSError`` naming the port if ``bind_address``'s port is taken (jaxlib's
    service crashes the process on a taken port instead of raising)."""
    host, port = _split(bind_address)
    host = "::" if host in ("", "::") else host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as exc:
        raise OSError(f"port {port} is in use on this machine ({exc.strerror}), so the "
                      "coordination service cannot start there; choose another MASTER_PORT "
                      "/ init_method port") from None


def note_arrival(rank: int) -> None:
    """Notes in ``jaxpg-run``'s lobby folder (if any) that ``rank`` reached the rendezvous."""
    folder = os.environ.get(LOBBY_VAR)
    if folder:
        try:
            with open(os.path.join(folder, str(rank)), "ab"):
                pass
        except OSError:
            pass  # the launcher removed it (the attempt ended): nothing to note


def lobby_arrivals() -> set[int] | None:
    """The ranks ``jaxpg-run``'s lobby folder says arrived, or None without a lobby."""
    folder = os.environ.get(LOBBY_VAR)
    if not folder:
        return None
    try:
        return {int(n) for n in os.listdir(folder) if n.isdigit()}
    except OSError:
        return None


class _CapturedStderr:
    """Collects what is written to file descriptor 2 (JAX's C++ logs) inside the block.

    A fatal line (``F....`` or ``terminate called``) and everything after it is passed
    through at once, so an abort we did not foresee still shows its cause. Other text is
    kept in ``text`` and, at the end, written out only if it holds no C++ log line (a print
    from another thread) or ``JAXPG_DEBUG`` is set.
    """

    def __enter__(self) -> _CapturedStderr:
        self.text = b""
        self._passing = False
        try:
            sys.stderr.flush()
        except (AttributeError, ValueError):
            pass
        self._saved = os.dup(2)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 2)
        os.close(write_end)
        self._thread = threading.Thread(target=self._pump, args=(read_end,), daemon=True)
        self._thread.start()
        return self

    def _pump(self, fd: int) -> None:
        try:
            while chunk := os.read(fd, 65536):
                if not self._passing and (re.search(rb"^F\d{4} ", chunk, re.M)
                                          or b"terminate called" in chunk):
                    self._passing = True
                    os.write(self._saved, self.text)
                if self._passing:
                    os.write(self._saved, chunk)
                else:
                    self.text += chunk
        finally:
            os.close(fd)

    def __exit__(self, *exc: Any) -> None:
        try:
            sys.stderr.flush()
        except (AttributeError, ValueError):
            pass
        os.dup2(self._saved, 2)
        self._thread.join(5.0)
        if not self._passing and self.text and (show_cpp_logs()
                                                or not _ABSL_LINE.search(self.text)):
            os.write(self._saved, self.text)
        os.close(self._saved)


REMIND_AFTER_S = 60.0
REMIND_EVERY_S = 300.0


class _Reminder:
    """While a long startup wait lasts, says so on stderr: after ``REMIND_AFTER_S`` and then
    every ``REMIND_EVERY_S`` (a timeout of 30 minutes should not mean 30 silent minutes)."""

    def __init__(self, what: Callable[[float], str]):
        self._what = what
        self._fd = os.dup(2)  # the real stderr: the connect collects what goes to fd 2
        self._done = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        wait = REMIND_AFTER_S
        while not self._done.wait(wait):
            text = f"[jaxpg] {self._what(time.monotonic() - self._start)}\n".encode()
            try:
                os.write(self._fd, text)
            except OSError:
                return
            wait = REMIND_EVERY_S

    def stop(self) -> None:
        self._done.set()
        self._thread.join(1.0)
        os.close(self._fd)


def _waiting_text(address: str, rank: int, world: int, timeout: float,
                  lobby: Callable[[], Iterable[int] | None] | None) -> Callable[[float], str]:
    def text(waited: float) -> str:
        missing = ""
        if lobby is not None:
            try:
                arrived = lobby()
            except Exception:  # noqa: BLE001
                arrived = None
            if arrived is not None:
                missing = (f"; not arrived yet: ranks "
                           f"{sorted(set(range(world)) - set(arrived) - {rank})}")
        return (f"init_process_group (rank {rank} of {world}): still waiting after "
                f"{waited:.0f} s for all {world} processes to join the coordination service at "
                f"{address}{missing}; DistTimeoutError at the timeout ({timeout:.0f} s).")

    return text


def _registration_facts(log: str) -> tuple[int | None, int | None, list[int] | None]:
    """From the service's barrier error in ``log``: (joined, expected, missing task ids)."""
    count = re.search(r"# of tasks that reached the barrier: (\d+)/(\d+)", log)
    if count is None:
        return None, None, None
    names = re.search(r"Some timed out task names:\s*\n((?:\s*(?:/job:[^\s]*task:)?\d+\s*\n)+)",
                      log)
    missing = None
    if names:
        missing = sorted({int(m) for m in re.findall(r"(\d+)\s*$", names.group(1), re.M)})
    return int(count.group(1)), int(count.group(2)), missing


def _status(log: str) -> str | None:
    """The error status JAX's agent logged for its failed registration, e.g.
    ``INVALID_ARGUMENT: ...`` (first line), or None."""
    found = re.search(r"Error status: ([A-Z_]+: [^\n]*)", log)
    return found.group(1).strip() if found else None


def _timeout_error(address: str, rank: int, world: int, seconds: float, host: str,
                   log: str, lobby: Callable[[], Iterable[int] | None] | None) -> str:
    who = f"rank {rank} of {world}"
    joined, expected, missing = _registration_facts(log)
    if missing is None and lobby is not None:
        try:
            arrived = lobby()
        except Exception:  # noqa: BLE001 (a store gone: just say less)
            arrived = None
        if arrived is not None:
            arrived = set(arrived) | {rank}
            missing = sorted(set(range(world)) - arrived)
            joined = world - len(missing)
    if missing is not None and missing:
        count = joined if joined is not None else world - len(missing)
        return (f"init_process_group: {count} of {expected or world} processes joined within "
                f"{seconds:.1f} s; ranks that never joined: {missing} (this is {who}; the "
                f"coordination service at {address} is hosted by {host}). Check that every "
                "process started and calls init_process_group with the same world_size "
                "and init_method.")
    return (f"init_process_group: not every one of the {world} processes joined the "
            f"coordination service at {address} (hosted by {host}) within {seconds:.1f} s "
            f"(this is {who}; which ranks are missing is not known here). Check that every "
            "process started and reaches init_process_group, or that what listens at "
            f"{address} is this job's coordinator (the port may have been in use by another "
            "program when rank 0 tried to start it).")


def connect(
    address: str,
    process_id: int,
    num_processes: int,
    *,
    timeout: float,
    heartbeat_timeout: int,
    host: str,
    hosts_service: bool = False,
    shutdown_timeout: int = 300,
    lobby: Callable[[], Iterable[int] | None] | None = None,
    deadline: float | None = None,
) -> Any:
    """Connects a coordination-service client within ``timeout`` seconds and returns it.

    Args:
        address: ``host:port`` of the service.
        process_id: this process's id (its rank, in ``[0, num_processes)``).
        num_processes: the number of processes the service waits for.
        timeout: seconds to wait for the coordinator and for every process to join.
        heartbeat_timeout: seconds without heartbeats after which a process counts as dead.
        host: who hosts the service, for messages ("rank 0", "jaxpg-run").
        hosts_service: this process started the service, so there is nothing to wait for.
        shutdown_timeout: seconds the client's shutdown waits for the others.
        lobby: returns the ranks known to have arrived (or None), when the service's own
            answer does not name the missing ones.
        deadline: when to give up (``time.monotonic()``), if the timeout began earlier
            (at ``init_process_group``); default ``timeout`` from now.

    Raises:
        DistTimeoutError: nothing listened at ``address``, or not every process joined,
            within ``timeout``; the message names the address or the missing ranks.
        DistBackendError: the service refused this process (e.g. a rank out of range).
    """
    if deadline is None:
        deadline = time.monotonic() + timeout
    who = f"rank {process_id} of {num_processes}"
    reminder = _Reminder(_waiting_text(address, process_id, num_processes, timeout, lobby))
    try:
        return _connect(address, process_id, num_processes, timeout, heartbeat_timeout, host,
                        hosts_service, shutdown_timeout, lobby, deadline, who)
    finally:
        reminder.stop()


def _connect(address: str, process_id: int, num_processes: int, timeout: float,
             heartbeat_timeout: int, host: str, hosts_service: bool, shutdown_timeout: int,
             lobby: Callable[[], Iterable[int] | None] | None, deadline: float,
             who: str) -> Any:
    if not hosts_service and not wait_until_listening(address, deadline):
        raise DistTimeoutError(
            f"init_process_group: could not reach the coordinator at {address} within "
            f"{timeout:.1f} s (this is {who}); ranks that never joined: [0], which should "
            f"host it ({host}). Check that rank 0 started, that it uses the same address and "
            "port, and that this host can reach it.")
    left = max(1, math.ceil(deadline - time.monotonic()))
    client = _jax_compat.joining_client(
        address, process_id, init_timeout=left, heartbeat_timeout=heartbeat_timeout,
        shutdown_timeout=shutdown_timeout, use_compression=True)
    failure: BaseException | None = None
    with _CapturedStderr() as captured:
        try:
            client.connect()
        except Exception as err:  # noqa: BLE001 (jaxlib raises RuntimeError; re-raised named)
            failure = err
            try:
                client.shutdown()
            except Exception:  # noqa: BLE001 (the agent is in its error state already)
                pass
    if failure is None:
        return client
    log = captured.text.decode(errors="replace")
    status = _status(log)
    if status is not None and not status.startswith(("DEADLINE_EXCEEDED", "UNAVAILABLE",
                                                      "ABORTED", "CANCELLED")):
        raise DistBackendError(
            f"init_process_group: the coordination service at {address} refused {who}: "
            f"{status}. Check that every process passes the same world_size and a rank in "
            f"[0, {num_processes}).") from None
    raise DistTimeoutError(_timeout_error(address, process_id, num_processes, timeout, host,
                                          log, lobby)) from None
