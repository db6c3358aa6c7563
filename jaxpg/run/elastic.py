"""Elastic membership (``--nnodes MIN:MAX``): the nodes present make each attempt.

Every launcher joins the store that node 0's launcher serves (:mod:`jaxpg.run.rdzv_store`)
and sends a heartbeat every ``heartbeat / 4`` seconds. Node 0's launcher leads:

* **Rendezvous.** For attempt k it waits until at least MIN nodes are present, then up to
  ``last_call`` seconds more for others (or until MAX), and publishes the members (sorted
  node ids) and the workers' coordinator port. A node's ``GROUP_RANK`` is its place among
  the members, so ``WORLD_SIZE``, ``RANK`` and ``GROUP_RANK`` change with the membership.
* **Watch.** While the workers run, it declares a member lost when its heartbeat has not
  changed for ``heartbeat`` seconds (by node 0's clock), and ends the attempt: "node 2 left".
  A node that joins while an attempt runs ends it too ("node 2 joined"), when fewer than
  MAX nodes are members. Every launcher then stops its workers.
* **Restarts.** A left node or a failed worker uses one of ``--max-restarts``; a joined
  node does not (torchrun's accounting). With fewer than MIN nodes left, node 0 waits up
  to ``join_timeout`` for others and then ends the job, naming the shortfall.

If node 0's launcher is lost, every other launcher's next request fails (connection reset
or refused, at once; or, with no answer at all, after ``heartbeat`` seconds): it stops its
workers and exits 1 with ``lost node 0's launcher (the rendezvous host at A:P)``.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

from jaxpg.run.rdzv_store import RendezvousClient, RendezvousHostLost, RendezvousServer

__all__ = ["ElasticNodes", "ElasticSettings", "RendezvousHostLost"]


@dataclass
class ElasticSettings:
    """``--nnodes MIN:MAX`` and ``--rdzv-conf`` (seconds)."""

    min_nodes: int
    max_nodes: int
    heartbeat: float = 10.0
    last_call: float = 2.0
    join_timeout: float = 600.0


class ElasticNodes:
    """This launcher's view of an elastic job: the same calls as ``NodeChannel`` (so the
    attempt's watch loop is shared) plus the membership of each attempt.

    Args:
        master_addr: node 0's address.
        master_port: the rendezvous port (node 0 serves it).
        node_id: this node's ``--node-rank``: its name in the job, unique; 0 leads.
        run_id: ``--rdzv-id``, or None to take node 0's.
        settings: the elastic settings.
        say: prints a launcher message.
    """

    def __init__(self, master_addr: str, master_port: int, node_id: int, run_id: str | None,
                 settings: ElasticSettings, say):
        self.node_id, self.settings, self._say = node_id, settings, say
        self.leader = node_id == 0
        self._server = RendezvousServer(master_port) if self.leader else None
        self._store = RendezvousClient(master_addr, master_port,
                                       timeout=settings.join_timeout if not self.leader
                                       else 10.0)
        self._store._timeout = settings.heartbeat
        self._store._sock.settimeout(settings.heartbeat)
        self.members: list[int] = []
        self.restarts_used = 0
        self._seen: dict[int, tuple[str, float]] = {}  # leader: last heartbeat, when seen
        self._beats = 0
        self._lost_error: Exception | None = None  # before _wait_for, which checks it
        self._stop = threading.Event()
        if self.leader:
            import uuid

            self._store.set("run_id", run_id or uuid.uuid4().hex[:12])
        self.run_id = self._wait_for("run_id")
        self._beat()
        threading.Thread(target=self._heartbeats, daemon=True).start()

    # heartbeats and liveness -------------------------------------------------------------

    def _beat(self) -> None:
        self._beats += 1
        self._store.set(f"alive/{self.node_id}", str(self._beats))

    def _heartbeats(self) -> None:
        while not self._stop.wait(self.settings.heartbeat / 4):
            try:
                self._beat()
            except Exception as err:  # noqa: BLE001 (the main loop raises it)
                self._lost_error = err
                return

    def _check(self) -> None:
        if self._lost_error is not None:
            raise self._lost_error

    def live_nodes(self) -> list[int]:
        """Leader: the nodes whose heartbeat changed within ``heartbeat`` seconds."""
        now = time.monotonic()
        for key, beat in self._store.list("alive/").items():
            node = int(key.rpartition("/")[2])
            if self._seen.get(node, ("", 0.0))[0] != beat:
                self._seen[node] = (beat, now)
        return sorted(n for n, (_, t) in self._seen.items()
                      if n == self.node_id or now - t <= self.settings.heartbeat)

    def _wait_for(self, key: str, timeout: float | None = None) -> str:
        deadline = time.monotonic() + (self.settings.join_timeout if timeout is None
                                       else timeout)
        while (value := self._store.get(key)) is None:
            self._check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"rendezvous: {key!r} was not published within "
                                   f"{self.settings.join_timeout:.0f} s")
            time.sleep(0.1)
        return value

    # the settings every node must share --------------------------------------------------

    def agree(self, settings: dict[str, int]) -> None:
        """Raises ValueError naming a setting that differs from node 0's."""
        mine = json.dumps(settings, sort_keys=True)
        if self.leader:
            self._store.set("settings", mine)
            return
        theirs = json.loads(self._wait_for("settings"))
        for name, value in settings.items():
            if theirs.get(name) != value:
                raise ValueError(f"{name} is {value} on node {self.node_id} but "
                                 f"{theirs.get(name)} on node 0; start every node with the "
                                 "same value")

    # one attempt's membership ------------------------------------------------------------

    def rendezvous(self, attempt: int, port: int | None,
                   host=None) -> tuple[list[int], int] | None:
        """Attempt ``attempt``'s members and coordinator port; None for a node left out of
        it (it waits for the next). The leader passes its port and ``host(members)``,
        which starts the workers' coordination service before the members are published."""
        key = f"attempt/{attempt}"
        if self.leader:
            members = self._gather()
            if host is not None:
                host(members)
            self._store.set(key, json.dumps({"members": members, "port": port}))
        else:
            while True:
                if (end := self._store.get("end")) is not None:
                    raise _JobEnded(json.loads(end))
                if (value := self._store.get(key)) is not None:
                    break
                self._check()
                time.sleep(0.1)
            record = json.loads(value)
            members, port = record["members"], record["port"]
        old, self.members = self.members, members
        if old and old != members:
            left, joined = sorted(set(old) - set(members)), sorted(set(members) - set(old))
            self._say(f"attempt {attempt}: {len(members)} nodes {members}"
                      + (f"; left: {left}" if left else "")
                      + (f"; joined: {joined}" if joined else ""))
        if self.node_id not in members:
            return None
        return members, int(port)

    def _gather(self) -> list[int]:
        s = self.settings
        deadline = time.monotonic() + s.join_timeout
        while len(live := self.live_nodes()) < s.min_nodes:
            if time.monotonic() > deadline:
                message = (f"only {len(live)} nodes {live} present, fewer than --nnodes "
                           f"minimum {s.min_nodes}, within join_timeout "
                           f"{s.join_timeout:.0f} s")
                self.end(1, message)
                raise _JobEnded({"code": 1, "message": message})
            time.sleep(0.2)
        last_call = time.monotonic() + s.last_call
        while len(live) < s.max_nodes and time.monotonic() < last_call:
            time.sleep(0.2)
            live = self.live_nodes()
        return live[: s.max_nodes]

    # NodeChannel's calls, used by the attempt's watch loop ------------------------------

    @property
    def nnodes(self) -> int:
        return len(self.members)

    def publish_port(self, attempt: int, port: int) -> None:
        pass  # published with the members

    def report_failure(self, attempt: int, message: str) -> None:
        self._store.setnx(f"attempt/{attempt}/failed", message)

    def failure(self, attempt: int) -> str | None:
        self._check()
        if self.leader:
            live = self.live_nodes()
            lost = [n for n in self.members if n not in live]
            if lost:
                self.report_failure(attempt, f"node {lost[0]} left (no heartbeat for "
                                             f"{self.settings.heartbeat:.0f} s)")
            elif (new := [n for n in live if n not in self.members]) and (
                    len(self.members) < self.settings.max_nodes):
                self._store.setnx(f"attempt/{attempt}/joined", "1")
                self.report_failure(attempt, f"node {new[0]} joined")
        return self._store.get(f"attempt/{attempt}/failed")

    def report_success(self, attempt: int) -> None:
        self._store.set(f"attempt/{attempt}/succeeded/{self.node_id}", "1")

    def all_succeeded(self, attempt: int) -> bool:
        done = self._store.list(f"attempt/{attempt}/succeeded/")
        return len(done) >= len(self.members)

    def share_lobby(self, attempt: int, lobby: str) -> None:
        pass  # the lobby only names missing ranks in startup timeouts; per node here

    def barrier(self, name: str) -> None:
        """After an attempt: every member says it stopped; the leader waits for the live
        ones (a lost member never will)."""
        self._store.set(f"{name}/{self.node_id}", "1")
        if not self.leader:
            return
        deadline = time.monotonic() + self.settings.heartbeat + 30
        while time.monotonic() < deadline:
            stopped = {int(k.rpartition("/")[2]) for k in self._store.list(f"{name}/")}
            if all(n in stopped or n not in self.live_nodes() for n in self.members):
                return
            time.sleep(0.2)

    def joined_only(self, attempt: int) -> bool:
        """Whether attempt ``attempt`` ended because a node joined (not counted as a
        restart)."""
        failed = self._store.get(f"attempt/{attempt}/failed") or ""
        return failed.endswith(" joined")

    def end(self, code: int, message: str) -> None:
        """Leader: tells every launcher that the job ends."""
        self._store.set("end", json.dumps({"code": code, "message": message}))

    def close(self) -> None:
        """Leaves; the leader waits (up to 10 s) for the others to read the end first."""
        self._stop.set()
        if self.leader:
            try:
                self._store.set(f"closed/{self.node_id}", "1")
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    closed = self._store.list("closed/")
                    if all(f"closed/{n}" in closed for n in self.members):
                        break
                    time.sleep(0.1)
            except Exception:  # noqa: BLE001
                pass
        else:
            try:
                self._store.set(f"closed/{self.node_id}", "1")
            except Exception:  # noqa: BLE001
                pass
        self._store.close()
        if self._server is not None:
            self._server.shutdown()


class _JobEnded(Exception):
    """Node 0 ended the job (``{"code", "message"}``)."""

    def __init__(self, record: dict):
        super().__init__(record["message"])
        self.code = int(record["code"])
