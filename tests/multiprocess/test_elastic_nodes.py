"""jaxpg-run --nnodes MIN:MAX across hosts: one launcher per network namespace on a bridge
(``_netns.bridged_hosts``, host i at 192.0.2.(i+1), node 0 the rendezvous host). A lost
node's launcher starts the next attempt with the nodes present (new WORLD_SIZE, RANK,
GROUP_RANK; stderr names the node that left) within the heartbeat timeout plus a few
seconds, and a node started again joins (scale-up); a lost node 0 ends every other launcher
with a named error; FSDP with asynchronous checkpoints finishes on the nodes left with the
uninterrupted run's parameters. Each fault test states its bound."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _child_env import child_env
from _cluster import unavailable
from _netns import bridged_hosts, host_address, inside, why_no_namespaces

WORKER = Path(__file__).parent / "workers" / "elastic_members.py"
FSDP_WORKER = Path(__file__).parent / "workers" / "elastic_fsdp.py"
HEARTBEAT = 4.0  # --rdzv-conf heartbeat: a node silent this long has left


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One node's launcher, in its own session (so that killing it takes its workers)."""

    def __init__(self, rank: int | None, nnodes: str, port: int, restarts: int = 1,
                 script: list[str] | None = None, rdzv: list[str] | None = None,
                 host: str | None = None, master: str = "127.0.0.1", **env_vars: str):
        """``rdzv``: the rendezvous flags instead of ``--master-addr/--master-port``;
        ``host``: the network namespace to run in (None: this machine's); ``master``: node
        0's address; ``env_vars``: more environment for the launcher and its workers;
        ``rank`` None: no ``--node-rank`` (node ranks in join order)."""
        env = child_env(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **env_vars)
        where = rdzv or ["--master-addr", master, "--master-port", str(port)]
        prefix = inside(host) if host else []  # nsenter execs: the launcher keeps its pid
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "jaxpg.run", "--nnodes", nnodes,
             *([] if rank is None else ["--node-rank", str(rank)]), *where, "--max-restarts",
             str(restarts), "--grace-period", "1", "--rdzv-conf",
             f"heartbeat={HEARTBEAT},last_call_timeout=2", *(script or [str(WORKER)])],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            start_new_session=True)
        self.out: list[str] = []
        self.err: list[tuple[float, str]] = []
        self.readers = [threading.Thread(target=lambda: self.out.extend(self.proc.stdout),
                                         daemon=True),
                        threading.Thread(target=self._read_err, daemon=True)]
        for reader in self.readers:
            reader.start()

    def _read_err(self) -> None:
        for line in self.proc.stderr:
            self.err.append((time.monotonic(), line))

    def envs(self) -> list[dict]:
        return [json.loads(line.split("ENV ", 1)[1]) for line in list(self.out)
                if "ENV " in line]

    def stderr(self) -> str:
        return "".join(line for _, line in list(self.err))

    def kill(self) -> float:
        os.killpg(self.proc.pid, signal.SIGKILL)
        return time.monotonic()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for reader in self.readers:
            reader.join(timeout=10)
        self.proc.stdout.close()
        self.proc.stderr.close()


@contextlib.contextmanager
def hosts(n: int):
    """``n`` hosts on a bridge (network namespaces): ``(names, switch namespace)``."""
    reason = why_no_namespaces()
    if reason is not None:  # CI runs as root with JAXPG_REQUIRE_CLUSTER_TESTS=1: a failure
        unavailable(f"cannot make network namespaces: {reason}")
    with bridged_hosts(n) as made:
        yield made


def on_hosts(names: list[str], nnodes: str, port: int, **kwargs) -> list[Node]:
    """One node per host, node ``r`` on host ``r``, node 0's address the master."""
    return [Node(r, nnodes, port, host=ns, master=host_address(0), **kwargs)
            for r, ns in enumerate(names)]


def _wait(cond, timeout: float, what: str, nodes) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s\n" + "\n".join(
                n.stderr()[-2000:] + "".join(n.out)[-1000:] for n in nodes))
        time.sleep(0.1)


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "3:2", "x.py"], "--nnodes MIN:MAX needs MIN <= MAX, got '3:2'"),
    (["--nnodes", "0:2", "x.py"], "--nnodes MIN must be at least 1, got 0"),
    (["--nnodes", "1:2", "x.py"], "--nnodes 1:2 needs --master-port"),
    (["--nnodes", "1:2", "--master-port", "1", "--node-rank", "2", "x.py"],
     "--node-rank must be in [0, --nnodes=2)"),
    (["--rdzv-conf", "beat=1", "x.py"], "--rdzv-conf takes key=seconds with keys"),
    (["--rdzv-conf", "heartbeat=0", "x.py"], "heartbeat must be a positive number"),
    (["--nnodes", "1:2", "--master-port", "1", "--coordinator", "rank0", "x.py"],
     "--nnodes MIN:MAX needs --coordinator launcher"),
])  # fmt: skip
def test_bad_elastic_flags_give_a_clear_error(argv, message, capsys):
    from jaxpg.run import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_lost_node_restarts_on_the_nodes_present_and_a_node_added_back_joins(tmp_path):
    with hosts(3) as (names, _):
        _lost_node_and_scale_up(names)


def _lost_node_and_scale_up(names: list[str]) -> None:
    port = _free_port()
    script = [str(WORKER), "2"]  # the workers wait through attempts 0 and 1
    nodes = on_hosts(names, "2:3", port, script=script)
    try:
        _wait(lambda: all(n.envs() for n in nodes), 120, "3 workers started", nodes)
        assert sorted(n.envs()[0]["RANK"] for n in nodes) == ["0", "1", "2"]
        assert all(n.envs()[0]["WORLD_SIZE"] == "3" for n in nodes)
        killed_at = nodes[1].kill()  # node 1's launcher and worker, SIGKILL
        survivors = [nodes[0], nodes[2]]
        # Bound: the heartbeat timeout, + 0.5 s polling, + 1 s grace to stop the workers,
        # + 2 s last call, + 6 s for a loaded machine.
        bound = HEARTBEAT + 0.5 + 1 + 2 + 6
        _wait(lambda: all(any("attempt 1:" in line for _, line in n.err) for n in survivors),
              bound + 30, "the next attempt announced", survivors)
        started = max(next(t for t, line in n.err if "attempt 1:" in line) for n in survivors)
        assert started - killed_at < bound, (started - killed_at, survivors[0].stderr())
        for n in survivors:
            assert "attempt 1: 2 nodes [0, 2]; left: [1]" in n.stderr()
        assert "node 1 left (no heartbeat" in nodes[0].stderr()
        _wait(lambda: all(len(n.envs()) == 2 for n in survivors), 120, "attempt 1's workers",
              survivors)
        assert [(e["RANK"], e["GROUP_RANK"], e["WORLD_SIZE"], e["TORCHELASTIC_RESTART_COUNT"])
                for e in (n.envs()[-1] for n in survivors)] == [("0", "0", "2", "1"),
                                                                ("1", "1", "2", "1")]
        # scale-up: node 1 comes back; it joins attempt 2, which --max-restarts 1 allows
        # (a joined node uses no restart)
        nodes[1].close()
        nodes[1] = Node(1, "2:3", port, script=script, host=names[1], master=host_address(0))
        for n in nodes:
            assert n.proc.wait(timeout=150) == 0, n.stderr()[-3000:]
        assert "node 1 joined" in nodes[0].stderr()
        assert "attempt 2: 3 nodes [0, 1, 2]; joined: [1]" in nodes[0].stderr()
        third = [n.envs()[-1] for n in nodes]
        assert [(e["RANK"], e["GROUP_RANK"], e["WORLD_SIZE"], e["TORCHELASTIC_RESTART_COUNT"])
                for e in third] == [("0", "0", "3", "2"), ("1", "1", "3", "2"),
                                    ("2", "2", "3", "2")]
        assert all("DONE world=3" in "".join(n.out) for n in nodes)
    finally:
        for n in nodes:
            n.close()


def test_the_endpoints_host_serves_and_node_ids_follow_the_order_of_joining():
    from jaxpg.run.rdzv_join import claim_in_join_order, is_local_host, serve_if_local
    from jaxpg.run.rdzv_store import RendezvousClient

    assert is_local_host("127.0.0.1") and not is_local_host("192.0.2.77")
    port = _free_port()
    assert serve_if_local("192.0.2.77", port) is None  # another machine's: join it
    server = serve_if_local("127.0.0.1", port)
    assert server is not None
    assert serve_if_local("127.0.0.1", port) is None  # served here already: join it
    clients = [RendezvousClient("127.0.0.1", port, timeout=5) for _ in range(3)]
    try:
        assert claim_in_join_order(clients[0]) == 0  # the server's launcher
        assert [claim_in_join_order(c, 1) for c in clients[1:]] == [1, 2]
        assert claim_in_join_order(clients[1], 1) == 3  # a node started again: a new id
    finally:
        for c in clients:
            c.close()
        server.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchruns_command_without_node_rank_takes_node_ranks_in_join_order():
    with hosts(3) as (names, _):
        _join_order(names)


def _join_order(names: list[str]) -> None:
    port = _free_port()
    rdzv = ["--rdzv-endpoint", f"{host_address(0)}:{port}", "--rdzv-id", "job"]
    script = [str(WORKER), "0"]  # every attempt's workers join the world at once
    # the joining hosts first: they wait for the launcher on the endpoint's host to serve it
    nodes = [Node(None, "2:3", port, script=script, rdzv=rdzv, host=names[i]) for i in (1, 2)]
    try:
        _wait(lambda: all("joining the rendezvous" in n.stderr() for n in nodes), 60,
              "the joining launchers waiting", nodes)
        nodes.insert(0, Node(None, "2:3", port, script=script, rdzv=rdzv, host=names[0]))
        for n in nodes:
            assert n.proc.wait(timeout=150) == 0, n.stderr()[-3000:]
        assert f"serving the rendezvous at {host_address(0)}:{port} as node 0" in \
            nodes[0].stderr()
        ids = sorted(int(re.search(r"as node (\d+)", n.stderr()).group(1)) for n in nodes)
        assert ids == [0, 1, 2]
        final = [n.envs()[-1] for n in nodes]
        assert final[0]["GROUP_RANK"] == "0"  # the endpoint's host serves and leads
        assert sorted(e["GROUP_RANK"] for e in final) == ["0", "1", "2"]
        assert all(e["WORLD_SIZE"] == "3" for e in final)
        assert all("DONE world=3" in "".join(n.out) for n in nodes)
    finally:
        for n in nodes:
            n.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_launcher_that_can_neither_reach_nor_host_the_rendezvous_says_so():
    # 192.0.2.77 is no address of this machine (documentation range), and nothing answers
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "jaxpg.run", "--nnodes", "2:3", "--rdzv-endpoint",
         f"192.0.2.77:{_free_port()}", "--rdzv-id", "job", "--rdzv-conf", "join_timeout=3",
         str(WORKER)], capture_output=True, text=True, timeout=50,
        env=child_env(JAX_PLATFORMS="cpu"))
    assert result.returncode == 1, result.stderr
    # Bound: join_timeout (3 s), + the launcher's start, + 10 s for a loaded machine.
    assert time.monotonic() - start < 20
    assert "could not reach node 0's launcher (the rendezvous at 192.0.2.77:" in result.stderr
    assert "it is not an address of this machine, so this launcher cannot serve it" in \
        result.stderr
    assert "ENV " not in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_losing_node_0_ends_the_others_with_a_named_error():
    with hosts(2) as (names, _):
        _losing_node_0(names)


def _losing_node_0(names: list[str]) -> None:
    port = _free_port()
    nodes = on_hosts(names, "1:2", port)
    try:
        _wait(lambda: all(n.envs() for n in nodes), 120, "2 workers started", nodes)
        killed_at = nodes[0].kill()
        # Bound: a refused or reset connection is seen at the next poll (0.5 s); without
        # any answer the request times out after the heartbeat timeout; + 1 s grace to stop
        # the workers, + 5 s for a loaded machine.
        bound = HEARTBEAT + 0.5 + 1 + 5
        assert nodes[1].proc.wait(timeout=bound + 30) == 1
        ended = time.monotonic()
        assert ended - killed_at < bound, (ended - killed_at, nodes[1].stderr())
        assert (f"lost node 0's launcher (the rendezvous host at {host_address(0)}:"
                in nodes[1].stderr())
    finally:
        for n in nodes:
            n.close()


def _reference(steps: int) -> dict:
    """An uninterrupted one-device run on the same global batches (the epoch's permutation
    cut into slices of 12: what the ranks' DistributedSampler shares add up to)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "fsdp"))
    import jax
    import numpy as np
    import optax
    from _fsdp_models import Net, Reference

    from jaxpg.ddp import DistributedSampler

    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((48, 7)).astype(np.float32),
            "y": rng.integers(0, 5, 48).astype(np.int32)}
    ref = Reference(Net(0), optax.adam(1e-2))
    sampler = DistributedSampler(48, num_replicas=1, rank=0, shuffle=True, seed=5)
    for step in range(steps):
        epoch, b = divmod(step, 4)
        sampler.set_epoch(epoch)
        idx = sampler.indices()[b * 12:(b + 1) * 12]
        ref.step({k: v[idx] for k, v in data.items()})
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(ref.params)[0]}


def assert_uninterrupted(path, steps: int) -> None:
    """The parameters a job saved at ``path`` equal an uninterrupted run's, to 1e-5."""
    import numpy as np

    got, want = dict(np.load(path)), _reference(steps)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_fsdp_losing_a_node_finishes_on_two_to_the_uninterrupted_parameters(tmp_path):
    with hosts(3) as (names, _):
        _fsdp_losing_node_2(names, tmp_path)


def _fsdp_losing_node_2(names: list[str], tmp_path: Path) -> None:
    steps, port = 8, _free_port()
    script = [str(FSDP_WORKER), str(tmp_path / "ckpt"), str(tmp_path / "out.npz"), str(steps)]
    nodes = on_hosts(names, "2:3", port, script=script)
    try:
        _wait(lambda: any("KILLME" in line for line in list(nodes[2].out)), 240,
              "node 2 at step 4", nodes)
        nodes[2].kill()
        for n in nodes[:2]:
            assert n.proc.wait(timeout=240) == 0, n.stderr()[-3000:] + "".join(n.out)[-2000:]
        out = "".join(nodes[0].out)
        assert "RESUMED step=0 world=3 attempt=0" in out
        # the newest complete checkpoint: step 4's, or step 2's when node 2 was killed while
        # step 4's asynchronous write was still being committed
        assert re.search(r"RESUMED step=(2|4) world=2 attempt=1", out), out
        assert "attempt 1: 2 nodes [0, 1]; left: [2]" in nodes[0].stderr()
        assert_uninterrupted(tmp_path / "out.npz", steps)
    finally:
        for n in nodes:
            n.close()
