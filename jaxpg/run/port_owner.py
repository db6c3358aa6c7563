"""Whether a process listens on a TCP port (Linux's ``/proc``), for the launcher's checks.

``jax.distributed.initialize`` in a script makes process 0 start JAX's coordination service
on the address it is given. Under ``jaxpg-run --coordinator launcher`` that is the port
where the launcher already hosts the service, and both listen there (gRPC binds with
``SO_REUSEPORT``): each process's connection lands on one or the other service at random,
and a job whose processes split between them waits in ``initialize`` for ever. The launcher
looks for rank 0 listening on that port and stops the job with the fix instead.
"""

from __future__ import annotations

import os

__all__ = ["listens"]

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def _listening_inodes(pid: int, port: int) -> set[str]:
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if (len(fields) > 9 and fields[3] == _LISTEN
                            and int(fields[1].rpartition(":")[2], 16) == port):
                        found.add(fields[9])
        except (OSError, ValueError):
            continue
    return found


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a socket listening on TCP ``port`` (False where
    ``/proc`` cannot tell: another system, or the process is gone)."""
    wanted = _listening_inodes(pid, port)
    return bool(wanted) and bool(wanted & _socket_inodes(pid))
