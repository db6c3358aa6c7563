"""Rank 0's coordination service, hosted in a small child process rank 0 starts.

``jax.distributed.initialize`` hosts JAX's coordination service inside process 0, so when
process 0 dies the service dies with it, and JAX's agent in every other process ends that
process with a C++ fatal error ("Terminating process because the JAX distributed service
detected fatal errors"; jax 0.10.2's ``missed_heartbeat_callback`` cannot replace it: it
fails with ``std::bad_cast`` when it fires). Without a launcher, jaxpg's rank 0 therefore
starts the service in a child process instead (recoverable mode, as ``jaxpg-run``'s
launcher does) and every process, rank 0 included, joins it as a client
(:mod:`jaxpg.runtime.hosted_coordinator`). For the user it is still "rank 0 hosts the service":
same address, same port, nothing else to start.

The child's lifetime:

* rank 0 ends the world normally (``destroy_process_group``, ``jax.distributed.shutdown``
  through jaxpg, or the interpreter's exit): rank 0 waits until the other processes left
  (at most ``shutdown_timeout``), shuts its client down and tells the child to stop;
* rank 0 dies (its end of the pipe closes without a stop): the child keeps serving for
  ``JAXPG_COORDINATOR_LINGER`` seconds (default: the larger of 30 s and three heartbeat
  timeouts), so the survivors see rank 0 missing, name it and detach their clients
  (:mod:`jaxpg.supervision.liveness`), then stops. It never outlives rank 0 by more than that.

``JAXPG_COORDINATOR_PROCESS=0`` turns this off: process 0 hosts the service in-process,
as ``jax.distributed.initialize`` does (and a lost rank 0 ends the others in C++).
"""

from __future__ import annotations

import atexit
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ServiceProcess", "enabled", "linger_seconds", "start", "running", "finish",
           "wait_until_stopped"]

ENABLE_VAR = "JAXPG_COORDINATOR_PROCESS"
LINGER_VAR = "JAXPG_COORDINATOR_LINGER"
_READY = "jaxpg-coordinator-ready"


def enabled() -> bool:
    """Whether rank 0 hosts the service in a child process (the default)."""
    return os.environ.get(ENABLE_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def linger_seconds(heartbeat_timeout: float) -> float:
    """How long the child serves after rank 0 died (``JAXPG_COORDINATOR_LINGER``)."""
    value = os.environ.get(LINGER_VAR, "").strip()
    if not value:
        return max(30.0, 3.0 * heartbeat_timeout)
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{LINGER_VAR}={value!r} must be a number of seconds, e.g. 30.") from None
    if seconds < 0:
        raise ValueError(f"{LINGER_VAR}={value!r} must not be negative.")
    return seconds


class ServiceProcess:
    """The child process hosting the service; ``stop`` ends it (after a normal shutdown)."""

    def __init__(self, proc: subprocess.Popen, address: str) -> None:
        self.proc = proc
        self.address = address

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 10.0) -> None:
        """Tells the child to stop serving now and waits for it (kills it after
        ``timeout``)."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b"stop\n")
                self.proc.stdin.flush()
            except OSError:
                pass
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


_child: ServiceProcess | None = None


def running() -> ServiceProcess | None:
    """This process's service child, if it started one that has not been stopped."""
    return _child


def start(bind_address: str, num_processes: int, heartbeat_timeout: int,
          startup_timeout: float = 120.0, register_by: float | None = None) -> ServiceProcess:
    """Starts the child hosting a recoverable service on ``bind_address`` and waits until
    it listens.

    ``register_by`` (``time.time()``; default an hour from now) is until when the service
    waits for every process to register; then it answers the waiting ones with the names
    of the missing (:mod:`jaxpg.runtime.service_client`). It is a point in time, not a duration, so
    that the child's own start-up (seconds on a loaded machine) does not lengthen it.

    Raises:
        OSError: the child could not start the service (its message, e.g. the port is
            taken).
    """
    global _child
    if _child is not None:
        raise RuntimeError("this process already hosts a coordination service child")
    linger = linger_seconds(heartbeat_timeout)
    code = ("import runpy, sys; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.Popen(
        [sys.executable, "-c", code, os.path.abspath(__file__), bind_address,
         str(num_processes), str(heartbeat_timeout), str(linger),
         repr(time.time() + 3600 if register_by is None else register_by)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + startup_timeout
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            proc.kill()
            proc.wait()
            proc.stdin.close()
            proc.stdout.close()
            raise OSError(f"the coordination service child did not start within "
                          f"{startup_timeout:.0f} s")
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            break
        line += chunk
    text = line.decode(errors="replace").strip()
    if text != _READY:
        proc.wait(10)
        proc.stdin.close()
        proc.stdout.close()
        raise OSError(text or f"the coordination service child exited with {proc.returncode}")
    _child = ServiceProcess(proc, bind_address)
    atexit.register(_at_exit)
    return _child


def finish(client: Any, num_processes: int, timeout: float,
           shutdown: Callable[[], None]) -> None:
    """Rank 0's end of the world: waits until the other processes left the service (at most
    ``timeout``), calls ``shutdown`` (``jax.distributed.shutdown``) and stops the child.
    Errors are ignored: the world is going away."""
    global _child
    child, _child = _child, None
    if child is None:
        return
    try:
        deadline = time.monotonic() + timeout
        others = list(range(num_processes))
        while time.monotonic() < deadline:
            try:
                live = set(client.get_live_nodes(others))
            except Exception:  # noqa: BLE001 (service unreachable: nothing to wait for)
                break
            if not live - {0}:
                break
            time.sleep(0.05)
        try:
            shutdown()
        except Exception:  # noqa: BLE001
            pass
    finally:
        child.stop()


def wait_until_stopped(address: str, timeout: float) -> bool:
    """Waits until nothing accepts connections at ``address`` (rank 0 stopped the world's
    service child), at most ``timeout`` s; True if it saw that.

    The other processes leave before rank 0 stops the service: one that made a new world at
    once could otherwise join the old service just before it ends (and be ended by JAX in
    C++). Rank 0's next service starts a new Python first, so the gap is long enough to see.
    """
    import socket

    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                pass
        except OSError:
            return True
        time.sleep(0.05)
    return False


def _at_exit() -> None:
    """The interpreter exits without ``destroy_process_group``: end the world in order."""
    if _child is None:
        return
    from jaxpg._jax_compat import distributed_state

    state = distributed_state()
    if state.client is not None:
        finish(state.client, state.num_processes or 1, 300.0, state.shutdown)
    else:
        _child.stop()


def _serve(bind_address: str, num_processes: int, heartbeat_timeout: int,
           linger: float, register_by: float) -> int:
    """The child: hosts the service until told to stop, or ``linger`` s after EOF."""
    import socket

    err = os.fdopen(os.dup(2), "w")
    host, _, port = bind_address.rpartition(":")
    host = host.strip("[]") or "::"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family) as probe:  # jaxlib's service crashes on a taken port
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, int(port)))
    except OSError as exc:
        print(f"port {port} is in use on this machine ({exc.strerror}), so the coordination "
              "service cannot start there; choose another MASTER_PORT / init_method port",
              flush=True)
        return 1
    from jaxpg._jax_compat import distributed_runtime_service

    with open(os.devnull, "wb") as devnull:  # JAX's log lines; our own messages go to err
        os.dup2(devnull.fileno(), 2)
    try:
        service = distributed_runtime_service(
            bind_address, num_processes, heartbeat_timeout=heartbeat_timeout,
            cluster_register_timeout=max(1, int(register_by - time.time())),
            shutdown_timeout=5, recoverable=True)
    except Exception as exc:  # noqa: BLE001
        print(f"the coordination service could not start on {bind_address}: {exc}",
              flush=True)
        return 1
    print(_READY, flush=True)
    stopped = sys.stdin.buffer.readline().strip() == b"stop"
    if not stopped:  # rank 0 died: serve the survivors a while longer
        print(f"[jaxpg] rank 0 is gone; its coordination service on {bind_address} serves "
              f"the other processes {linger:.0f} s more ({LINGER_VAR}).", file=err, flush=True)
        err.close()  # rank 0's stderr: whoever reads it (a harness, a pipe) sees its end now
        time.sleep(linger)
    service.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]),
                    float(sys.argv[5])))
