"""What the launchers host and agree on: JAX's coordination service and restarts.

The launcher on node 0 hosts the workers' coordination service (JAX's key/value store,
barriers and heartbeats), one per attempt on a fresh port, as torchrun's agent hosts the
c10d store. No worker hosts it, so a worker's death, rank 0's included, never takes it down;
the service runs in recoverable mode, so a dead worker is not turned into a fatal error in
the others either. The launcher sees the death and stops or restarts the group.

With several nodes, the launchers meet through a second, small coordination service that
node 0's launcher hosts on ``--master-port``: it carries the run id, each attempt's worker
coordinator port, the first failure of an attempt (so every node stops and restarts
together) and the barriers between attempts.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from typing import Any

from jaxpg import _jax_compat

__all__ = ["LocalNodes", "NodeChannel", "PortInUseError", "WorkerCoordinator"]

# Heartbeat timeout of the launchers among themselves (several nodes).
AGENT_HEARTBEAT_S = 30


class PortInUseError(OSError):
    """The port for a coordination service is taken."""


def _probe(port: int) -> None:
    """Binds ``port`` on all interfaces for a moment; raises OSError if it is taken."""
    try:
        probe = socket.socket(socket.AF_INET6)
        where: tuple = ("::", port)
    except OSError:  # no IPv6 on this machine
        probe, where = socket.socket(socket.AF_INET), ("0.0.0.0", port)
    with probe:
        probe.bind(where)


def _start_service(address: str, num_nodes: int, heartbeat_timeout: int) -> Any:
    """A recoverable coordination service at ``address``, started without its log line
    ("Using experimental recoverable task feature ...") on the launcher's stderr; a failure
    still raises, with its message."""
    port = int(address.rpartition(":")[2])
    try:  # jaxlib's service crashes the process (SIGSEGV) on a port in use: check first
        _probe(port)
    except OSError as err:
        raise PortInUseError(
            f"port {port} is in use on this machine ({err.strerror}), so the coordination "
            "service cannot start there; pass another --master-port, or leave it out on one "
            "node to get a free one"
        ) from None
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 2)
        return _jax_compat.distributed_runtime_service(
            address, num_nodes, heartbeat_timeout=heartbeat_timeout, shutdown_timeout=5,
            recoverable=True,
        )  # fmt: skip
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class WorkerCoordinator:
    """JAX's coordination service for one attempt's workers, hosted in this process.

    Args:
        port: the port to listen on (all interfaces).
        num_processes: the number of workers in the job.
        heartbeat_timeout: seconds without heartbeats after which a worker counts as dead.
    """

    def __init__(self, port: int, num_processes: int, heartbeat_timeout: int = 100):
        self.port = port
        self._service = _start_service(f"[::]:{port}", num_processes, heartbeat_timeout)

    def shutdown(self) -> None:
        if self._service is not None:
            self._service.shutdown()
            self._service = None


class LocalNodes:
    """One node: nothing to agree with anybody."""

    nnodes = 1

    def __init__(self, run_id: str | None):
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self._failure: dict[int, str] = {}

    def agree(self, settings: dict[str, int]) -> None:
        pass

    def publish_port(self, attempt: int, port: int) -> None:
        pass

    def port(self, attempt: int) -> int:
        raise AssertionError("one node always hosts its own coordinator")

    def report_failure(self, attempt: int, message: str) -> None:
        self._failure.setdefault(attempt, message)

    def failure(self, attempt: int) -> str | None:
        return self._failure.get(attempt)

    def report_success(self, attempt: int) -> None:
        pass

    def share_lobby(self, attempt: int, lobby: str) -> None:
        pass

    def all_succeeded(self, attempt: int) -> bool:
        return True

    def barrier(self, name: str) -> None:
        pass

    def close(self) -> None:
        pass


class NodeChannel:
    """The launchers of a multi-node job, meeting on node 0's ``master_addr:master_port``.

    Args:
        master_addr: node 0's address.
        master_port: the port node 0's launcher listens on.
        nnodes: the number of nodes.
        node_rank: this node.
        run_id: ``--rdzv-id``, or None to take node 0's.
        timeout: seconds to wait for the other launchers (joining, between attempts).
    """

    def __init__(self, master_addr: str, master_port: int, nnodes: int, node_rank: int,
                 run_id: str | None, timeout: float = 300.0):
        self.nnodes, self.node_rank = nnodes, node_rank
        self._timeout_ms = int(timeout * 1000)
        self._service = None
        self._shared: dict[int, str] = {}
        self._nproc = 0  # --nproc-per-node, learned in agree()
        if node_rank == 0:
            self._service = _start_service(f"[::]:{master_port}", nnodes, AGENT_HEARTBEAT_S)
        self._client = _jax_compat.distributed_runtime_client(
            f"{master_addr}:{master_port}", node_rank, init_timeout=int(timeout),
            heartbeat_timeout=AGENT_HEARTBEAT_S, use_compression=True,
        )  # fmt: skip
        self._client.connect()
        if node_rank == 0:
            self._client.key_value_set("run_id", run_id or uuid.uuid4().hex[:12])
        self.run_id = self._client.blocking_key_value_get("run_id", self._timeout_ms)

    def agree(self, settings: dict[str, int]) -> None:
        """Checks that this node's ``settings`` equal node 0's (``--nproc-per-node``,
        ``--max-restarts``: ranks and restarts must be the same on every node).

        Raises:
            ValueError: naming the setting that differs.
        """
        self._nproc = int(settings.get("--nproc-per-node", 0))
        if self.node_rank == 0:
            self._client.key_value_set("settings", json.dumps(settings, sort_keys=True))
        else:
            theirs = json.loads(self._client.blocking_key_value_get("settings",
                                                                    self._timeout_ms))
            for name, value in settings.items():
                if theirs.get(name) != value:
                    self._client.key_value_set(
                        f"disagreement/{self.node_rank}",
                        f"{name} is {value} on node {self.node_rank} but {theirs.get(name)} on "
                        "node 0; start every node with the same value",
                    )
                    break
        self.barrier("settings")  # every node learns of a disagreement, node 0 included
        found = self._client.key_value_dir_get("disagreement/")
        if found:
            raise ValueError(found[0][1])

    def publish_port(self, attempt: int, port: int) -> None:
        self._client.key_value_set(f"attempt/{attempt}/port", str(port))

    def port(self, attempt: int) -> int:
        return int(self._client.blocking_key_value_get(f"attempt/{attempt}/port",
                                                       self._timeout_ms))

    def report_failure(self, attempt: int, message: str) -> None:
        try:
            self._client.key_value_set(f"attempt/{attempt}/failed", message)
        except Exception:  # another node reported first: its failure stands
            pass

    def failure(self, attempt: int) -> str | None:
        try:
            return self._client.key_value_try_get(f"attempt/{attempt}/failed")
        except Exception:
            return None

    def report_success(self, attempt: int) -> None:
        self._client.key_value_set(f"attempt/{attempt}/succeeded/{self.node_rank}", "1")

    def all_succeeded(self, attempt: int) -> bool:
        done = self._client.key_value_dir_get(f"attempt/{attempt}/succeeded/")
        return len(done) == self.nnodes

    def share_lobby(self, attempt: int, lobby: str) -> None:
        """Publishes which of this node's ranks reached ``init_process_group`` (files in
        ``lobby``) and copies the other nodes' into it, so that a worker's startup timeout
        names missing ranks on every node (:mod:`jaxpg.runtime.service_client`)."""
        try:
            here = sorted(n for n in os.listdir(lobby) if n.isdigit())
            mine = ",".join(n for n in here if self._is_mine(int(n)))
            if mine and mine != self._shared.get(attempt):
                self._client.key_value_set(f"attempt/{attempt}/lobby/{self.node_rank}", mine,
                                           allow_overwrite=True)
                self._shared[attempt] = mine
            for _, ranks in self._client.key_value_dir_get(f"attempt/{attempt}/lobby/"):
                for rank in filter(None, ranks.split(",")):
                    if rank not in here:
                        open(os.path.join(lobby, rank), "ab").close()
        except Exception:  # noqa: BLE001 (best effort: only messages depend on it)
            pass

    def _is_mine(self, rank: int) -> bool:
        return rank // self._nproc == self.node_rank if self._nproc else True

    def lost_nodes(self) -> list[int]:
        """The launchers that stopped sending heartbeats."""
        live = self._client.get_live_nodes(list(range(self.nnodes)))
        return sorted(set(range(self.nnodes)) - set(live))

    def barrier(self, name: str) -> None:
        self._client.wait_at_barrier(name, self._timeout_ms)

    def close(self) -> None:
        """Leaves together: a barrier, then each launcher's client, then node 0's service
        (a client whose service vanishes is ended by JAX with a C++ fatal error)."""
        try:
            self._client.wait_at_barrier("close", 30_000)
        except Exception:
            pass
        self._client.shutdown()
        if self._service is not None:
            time.sleep(1.0)  # the others' shutdown calls are in flight
            self._service.shutdown()
