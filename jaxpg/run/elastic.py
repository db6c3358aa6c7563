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

With ``--rdzv-backend etcd`` the store is an etcd server (:mod:`jaxpg.run.rdzv_etcd`) and
no node is special: each attempt's leader is elected (the lowest node id alive creates the
attempt's ``leader/k`` key, attached to its etcd lease; etcd's compare-and-swap keeps it
one), is the attempt's node rank 0 and hosts its
coordination service at its own address; restarts used are kept in the attempt's record;
every member watches the others' heartbeats. A lost leader's lease runs out after
``heartbeat`` seconds and another node leads the next attempt.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from jaxpg.run.rdzv_join import claim_in_join_order, is_local_host, serve_if_local
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
    max_restarts: int = 0


class ElasticNodes:
    """This launcher's view of an elastic job: the same calls as ``NodeChannel`` (so the
    attempt's watch loop is shared) plus the membership of each attempt.

    Args:
        master_addr: node 0's address (c10d), or the address this node's workers and the
            others reach its coordination service at (etcd).
        master_port: the rendezvous port (c10d: node 0 serves it).
        node_id: this node's ``--node-rank``: its name in the job, unique; with c10d, 0 leads.
            None: taken in join order (:mod:`jaxpg.run.rdzv_join`); with c10d the launcher
            on ``master_addr``'s machine serves the rendezvous and is node 0.
        run_id: ``--rdzv-id``, or None to take node 0's (c10d only).
        settings: the elastic settings.
        say: prints a launcher message.
        etcd: ``host:port`` of the etcd server for ``--rdzv-backend etcd``, else None.
    """

    def __init__(self, master_addr: str, master_port: int | None, node_id: int | None,
                 run_id: str | None, settings: ElasticSettings, say,
                 etcd: str | None = None):
        self.node_id, self.settings, self._say = node_id, settings, say
        self.addr = master_addr
        self.fixed_leader = etcd is None  # c10d: node 0 always leads
        self.leader = self.fixed_leader and node_id == 0
        self._server = None
        self.members: list[int] = []
        self._seen: dict[int, tuple[str, float]] = {}  # last heartbeat, when seen
        self._beats = 0
        self._lost_error: Exception | None = None  # before _wait_for, which checks it
        self._stop = threading.Event()
        if etcd is not None:
            from jaxpg.run.rdzv_etcd import EtcdStore

            self._store = EtcdStore(etcd, str(run_id), timeout=settings.heartbeat)
            self.run_id = str(run_id)
            if (end := self._store.get("end")) is not None:
                raise ValueError(f"--rdzv-id {run_id} names a job that already ended in the "
                                 f"etcd at {etcd} ({json.loads(end)['message']}); give each "
                                 "job a new --rdzv-id")
            self._claim_name()
        elif node_id is None:
            self._join_in_order(master_addr, int(master_port))
        else:
            self._server = RendezvousServer(master_port) if self.leader else None
            self._store = RendezvousClient(master_addr, master_port,
                                           timeout=settings.join_timeout if not self.leader
                                           else 10.0)
        if self.fixed_leader:
            self._store._timeout = settings.heartbeat
            self._store._sock.settimeout(settings.heartbeat)
            if self.leader:
                self._store.set("run_id", run_id or uuid.uuid4().hex[:12])
            self.run_id = self._wait_for("run_id")
        self._beat()
        threading.Thread(target=self._heartbeats, daemon=True).start()

    def _join_in_order(self, host: str, port: int) -> None:
        """c10d without ``--node-rank``: serves the rendezvous if ``host`` is this machine
        (then this launcher is node 0), else joins it; takes the next node id."""
        where = f"{host}:{port}"
        self._server = serve_if_local(host, port)
        self.leader = self._server is not None
        timeout = 10.0 if self.leader else self.settings.join_timeout
        if not self.leader:
            self._say(f"joining the rendezvous at {where} (the launcher on {host} serves it; "
                      f"waiting up to join_timeout {timeout:.0f} s)")
        try:
            self._store = RendezvousClient(host, port, timeout=timeout)
        except RendezvousHostLost as err:
            hosting = ("it is not an address of this machine, so this launcher cannot serve "
                       "it either" if not is_local_host(host) else "this machine's launcher "
                       "that serves it did not answer")
            raise RendezvousHostLost(
                f"{err}; {hosting}: start jaxpg-run on {host} with the same --rdzv-endpoint "
                "(it serves the rendezvous), or give the endpoint of a host that runs one"
            ) from None
        self.node_id = claim_in_join_order(self._store, 0 if self.leader else 1)
        self._say(f"{'serving' if self.leader else 'joined'} the rendezvous at {where} as "
                  f"node {self.node_id} (node ids in join order)")

    def _claim_name(self) -> None:
        """etcd: takes ``names/<node id>`` for this launcher's lease (without
        ``--node-rank``: the lowest free one); waits up to a heartbeat timeout for a lost
        launcher of the same id to let it go."""
        if self.node_id is None:
            self.node_id = claim_in_join_order(self._store, ephemeral=True)
            self._say(f"joined the rendezvous at etcd as node {self.node_id} (the lowest "
                      "free node id)")
            return
        token = uuid.uuid4().hex
        deadline = time.monotonic() + self.settings.heartbeat + 1
        while self._store.setnx(f"names/{self.node_id}", token, ephemeral=True) != token:
            if time.monotonic() > deadline:
                raise ValueError(f"--node-rank {self.node_id} is taken by another live "
                                 f"launcher of job --rdzv-id {self.run_id}; give each node "
                                 "its own --node-rank")
            time.sleep(0.2)

    # heartbeats and liveness -------------------------------------------------------------

    def _beat(self) -> None:
        self._beats += 1
        if self._store.leases:
            self._store.keepalive()
        self._store.set(f"alive/{self.node_id}", str(self._beats), ephemeral=True)

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
        """The nodes whose heartbeat key is there (etcd: their lease holds) and changed
        within ``heartbeat`` seconds, by this node's clock."""
        now = time.monotonic()
        alive = self._store.list("alive/")
        for key, beat in alive.items():
            node = int(key.rpartition("/")[2])
            if self._seen.get(node, ("", 0.0))[0] != beat:
                self._seen[node] = (beat, now)
        return sorted(n for n, (_, t) in self._seen.items() if n == self.node_id or (
            f"alive/{n}" in alive and now - t <= self.settings.heartbeat))

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
        if not self.fixed_leader:  # etcd: the first node's settings are the job's
            first = json.loads(self._store.setnx(
                "settings", json.dumps({"node": self.node_id, "settings": settings})))
            theirs, where = first["settings"], first["node"]
        elif self.leader:
            self._store.set("settings", mine)
            return
        else:
            theirs, where = json.loads(self._wait_for("settings")), 0
        for name, value in settings.items():
            if theirs.get(name) != value:
                raise ValueError(f"{name} is {value} on node {self.node_id} but "
                                 f"{theirs.get(name)} on node {where}; start every node with "
                                 "the same value")

    # one attempt's membership ------------------------------------------------------------

    def rendezvous(self, attempt: int, host: Callable[[list[int]], int],
                   code: int = 1) -> tuple[list[int], str, int] | None:
        """Attempt ``attempt``'s members (its node rank 0, the leader, first), and the
        address and port of its coordination service; None for a node left out of it (it
        waits for the next). The leader calls ``host(members)``, which starts the workers'
        coordination service and returns its port, before it publishes the members; for
        attempt k > 0 it first counts a restart for attempt k - 1 (``code``: this node's exit
        code for it) and ends the job when none is left."""
        key = f"attempt/{attempt}"
        while True:
            if (end := self._store.get("end")) is not None:
                raise _JobEnded(json.loads(end))
            if (value := self._store.get(key)) is not None:
                record = json.loads(value)
                break
            if self._leads(attempt):
                record = self._lead(attempt, host, code)
                break
            self._check()
            time.sleep(0.1)
        old, self.members = self.members, record["members"]
        self.leader = self.members[0] == self.node_id
        if old and set(old) != set(self.members):
            left = sorted(set(old) - set(self.members))
            joined = sorted(set(self.members) - set(old))
            self._say(f"attempt {attempt}: {len(self.members)} nodes {self.members}"
                      + (f"; left: {left}" if left else "")
                      + (f"; joined: {joined}" if joined else ""))
        if self.node_id not in self.members:
            return None
        # c10d: node 0 at this node's --master-addr, as every node names it
        addr = self.addr if self.fixed_leader else record["addr"]
        return self.members, addr, int(record["port"])

    def _leads(self, attempt: int) -> bool:
        """Whether this node leads attempt ``attempt`` (etcd: it holds ``leader/k``, which
        only the lowest node id it sees alive tries to take)."""
        if self.fixed_leader:
            return self.node_id == 0
        if self.live_nodes()[0] != self.node_id:
            return False
        me = str(self.node_id)
        return self._store.setnx(f"leader/{attempt}", me, ephemeral=True) == me

    def _lead(self, attempt: int, host: Callable[[list[int]], int], code: int) -> dict:
        restarts = 0
        if attempt > 0:
            restarts = self._after(attempt - 1)
            if restarts > self.settings.max_restarts:
                message = f"no restarts left (--max-restarts {self.settings.max_restarts})"
                self._say(f"{message}; giving up")
                record = {"code": code or 1, "message": message, "node": self.node_id}
                self._store.setnx("end", json.dumps(record))
                raise _JobEnded(record)
            self._say(f"starting attempt {attempt} with the nodes present (restarts used "
                      f"{restarts} of --max-restarts {self.settings.max_restarts})")
        others = [n for n in self._gather() if n != self.node_id]
        members = [self.node_id, *others[: self.settings.max_nodes - 1]]
        record = {"members": members, "addr": self.addr, "port": host(members),
                  "restarts": restarts}
        self._store.set(f"attempt/{attempt}", json.dumps(record))
        return record

    def _after(self, attempt: int) -> int:
        """Waits until attempt ``attempt`` has ended and its live members have stopped
        their workers (a lost member never will); returns the restarts used then."""
        while self._store.get(f"attempt/{attempt}/failed") is None:
            if (end := self._store.get("end")) is not None:
                raise _JobEnded(json.loads(end))
            self._check()
            time.sleep(0.2)
        members = json.loads(self._store.get(f"attempt/{attempt}"))
        deadline = time.monotonic() + self.settings.heartbeat + 30
        while time.monotonic() < deadline:
            stopped = {int(k.rpartition("/")[2]) for k in self._store.list(f"stopped/{attempt}/")}
            live = self.live_nodes()
            if all(n in stopped or n not in live for n in members["members"]):
                break
            time.sleep(0.2)
        return members.get("restarts", 0) + (0 if self.joined_only(attempt) else 1)

    def _gather(self) -> list[int]:
        s = self.settings
        deadline = time.monotonic() + s.join_timeout
        while len(live := self.live_nodes()) < s.min_nodes:
            if time.monotonic() > deadline:
                message = (f"only {len(live)} nodes {live} present, fewer than --nnodes "
                           f"minimum {s.min_nodes}, within join_timeout "
                           f"{s.join_timeout:.0f} s")
                self.end(1, message)
                raise _JobEnded({"code": 1, "message": message, "node": self.node_id})
            time.sleep(0.2)
        last_call = time.monotonic() + s.last_call
        while len(live) < s.max_nodes and time.monotonic() < last_call:
            time.sleep(0.2)
            live = self.live_nodes()
        return live

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
        if self.leader or not self.fixed_leader:  # etcd: every member watches
            live = self.live_nodes()
            lost = [n for n in self.members if n not in live]
            if lost:  # a member that finished and left is not lost
                done = self._store.list(f"attempt/{attempt}/succeeded/")
                lost = [n for n in lost if f"attempt/{attempt}/succeeded/{n}" not in done]
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
        """After an attempt: every member says it stopped (the next attempt's leader waits
        for the live ones before it starts)."""
        self._store.set(f"{name}/{self.node_id}", "1")

    def joined_only(self, attempt: int) -> bool:
        """Whether attempt ``attempt`` ended because a node joined (not counted as a
        restart)."""
        failed = self._store.get(f"attempt/{attempt}/failed") or ""
        return failed.endswith(" joined")

    def end(self, code: int, message: str) -> None:
        """Leader: tells every launcher that the job ends."""
        self._store.set("end", json.dumps({"code": code, "message": message,
                                           "node": self.node_id}))

    def close(self, finished: bool = False) -> None:
        """Leaves (``finished``: the job succeeded). c10d: node 0 waits (up to 10 s) for
        the others to read the end first. etcd: a finished job's ``end`` tells standby
        nodes; this launcher's lease goes, and its ephemeral keys with it."""
        self._stop.set()
        if not self.fixed_leader:
            try:
                if finished:
                    self._store.setnx("end", json.dumps(
                        {"code": 0, "message": "the job finished", "node": self.node_id}))
            except Exception:  # noqa: BLE001
                pass
        elif self.leader:
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
    """A leader ended the job (``{"code", "message", "node"}``)."""

    def __init__(self, record: dict):
        super().__init__(record["message"])
        self.code = int(record["code"])
        self.node = int(record.get("node", 0))
