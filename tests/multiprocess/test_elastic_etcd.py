"""jaxpg-run --nnodes MIN:MAX --rdzv-backend etcd against a real etcd server (Debian's
etcd-server): the store's calls and flag errors (etcd on free loopback ports), and a job of
three hosts (network namespaces on a bridge, etcd on the bridge's own address) that loses
node 0 (its launcher, its workers and the attempt's coordination service) and finishes on
the other two to the uninterrupted run's parameters."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from _cluster import free_port, unavailable
from _netns import SWITCH_ADDRESS, inside
from _procs import stop
from test_elastic_nodes import (
    FSDP_WORKER,
    HEARTBEAT,
    Node,
    _wait,
    assert_uninterrupted,
    hosts,
)


@contextlib.contextmanager
def running_etcd(data: Path, address: str = "127.0.0.1", client: int | None = None,
                 peer: int | None = None, prefix: list[str] = ()):
    """``host:port`` of a fresh etcd at ``address`` (its data in ``data``; ``prefix``:
    the command that puts it in a network namespace), stopped after."""
    if shutil.which("etcd") is None:
        unavailable("etcd is not installed (Debian: apt-get install etcd-server; "
                    ".ci/install_cluster_deps.sh does it)")
    client, peer = client or free_port(), peer or free_port()
    endpoint = f"{address}:{client}"
    log = open(data / "etcd.log", "w")  # noqa: SIM115 (closed when etcd has stopped)
    proc = subprocess.Popen(
        [*prefix, "etcd", "--name", "jaxpg-test", "--data-dir", str(data / "data"),
         "--listen-client-urls", f"http://{endpoint}",
         "--advertise-client-urls", f"http://{endpoint}",
         "--listen-peer-urls", f"http://{address}:{peer}",
         "--initial-advertise-peer-urls", f"http://{address}:{peer}",
         "--initial-cluster", f"jaxpg-test=http://{address}:{peer}"],
        stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while _etcd_get(endpoint, prefix, "", "version") is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("etcd did not start:\n"
                                     + (data / "etcd.log").read_text()[-3000:])
            time.sleep(0.2)
        yield endpoint
    finally:
        stop(proc, 30)
        log.close()


_GET = """
import sys
from jaxpg.run.rdzv_etcd import EtcdStore, probe_etcd
endpoint, run, key = sys.argv[1:]
if key == "version":
    probe_etcd(endpoint, timeout=1)
    print("VALUE up")
else:
    store = EtcdStore(endpoint, run, timeout=5.0)
    print("VALUE", store.get(key))
    store.close()
"""


def _etcd_get(endpoint: str, prefix: list[str], run: str, key: str) -> str | None:
    """The value of job ``run``'s ``key`` (``version``: whether etcd answers), read from
    where ``prefix`` puts the reader (etcd on a bridge is reachable from its namespaces
    only); None when it is unset or etcd does not answer."""
    done = subprocess.run([*prefix, sys.executable, "-c", _GET, endpoint, run, key],
                          capture_output=True, text=True, timeout=30)
    value = done.stdout.partition("VALUE ")[2].strip()
    return value if done.returncode == 0 and value != "None" else None


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    """``host:port`` of a fresh etcd on loopback, stopped after."""
    with running_etcd(tmp_path_factory.mktemp("etcd")) as endpoint:
        yield endpoint


@pytest.mark.slow
def test_the_etcd_store_sets_swaps_lists_and_drops_a_lost_launchers_keys(etcd):
    from jaxpg.run.rdzv_etcd import EtcdStore

    run = uuid.uuid4().hex
    a, b = EtcdStore(etcd, run, timeout=2.0), EtcdStore(etcd, run, timeout=2.0)
    other = EtcdStore(etcd, run + "x", timeout=2.0)  # another job: its own keys
    try:
        a.set("k/1", "one")
        b.set("k/2", "two", ephemeral=True)
        other.set("k/3", "three")
        assert (a.get("k/1"), b.get("k/2"), a.get("missing")) == ("one", "two", None)
        assert a.list("k/") == {"k/1": "one", "k/2": "two"}
        # compare-and-swap: the first writer wins, the second reads its value
        assert a.setnx("leader/0", "a") == "a"
        assert b.setnx("leader/0", "b") == "a"
        # b stops renewing its lease (time to live 2 s): its ephemeral key goes, a's stays
        a.keepalive()
        time.sleep(3.5)
        assert a.list("k/") == {"k/1": "one"}
        with pytest.raises(ConnectionError, match="lease .* expired"):
            b.keepalive()
    finally:
        for store in (a, b, other):
            store.close()


@pytest.mark.parametrize("flags, message", [
    (["--rdzv-backend", "zookeeper"], "--rdzv-backend must be c10d (the default"),
    (["--rdzv_backend", "etcd", "--nnodes", "1:2"],
     "--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:9", "--nnodes", "1:2"],
     "--rdzv-backend etcd needs --rdzv-id ID"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:FREE", "--rdzv-id", "j",
      "--nnodes", "1:2"], "--rdzv-endpoint 127.0.0.1:FREE (--rdzv-backend etcd): no etcd "
                          "answers there"),
])  # fmt: skip
def test_bad_etcd_flags_give_a_clear_error_before_anything_starts(flags, message, capsys):
    from jaxpg.run import main

    port = str(free_port())  # nothing listens there
    flags = [f.replace("FREE", port) for f in flags]
    with pytest.raises(SystemExit) as exit_info:
        main([*flags, "x.py"])
    assert exit_info.value.code == 2
    assert message.replace("FREE", port) in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_fsdp_losing_node_0_under_etcd_finishes_on_two_to_the_uninterrupted_parameters(
        tmp_path):
    with hosts(3) as (names, switch):
        (tmp_path / "etcd").mkdir()
        with running_etcd(tmp_path / "etcd", SWITCH_ADDRESS, 2379, 2380,
                          inside(switch)) as endpoint:
            _losing_node_0_under_etcd(names, switch, endpoint, tmp_path)


def _losing_node_0_under_etcd(names: list[str], switch: str, etcd: str,
                              tmp_path: Path) -> None:
    steps, run = 8, uuid.uuid4().hex[:12]
    rdzv = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd, "--rdzv-id", run]
    script = [str(FSDP_WORKER), str(tmp_path / "ckpt"), str(tmp_path / "out.npz"), str(steps)]
    nodes = [Node(0, "2:3", 0, script=script, rdzv=rdzv, host=names[0], ELASTIC_KILLME="1")]
    try:
        # node 0 first: the lowest node id alive leads each attempt (its node rank 0,
        # hosting the workers' coordination service), so losing node 0 loses the most. Node
        # 0's worker waits to be killed after step 4 of the first attempt with 3 nodes (the
        # third may join attempt 0, or start attempt 1 by joining it late).
        _wait(lambda: _etcd_get(etcd, inside(switch), run, "leader/0") == "0", 60,
              "node 0 leading attempt 0", nodes)
        nodes += [Node(r, "2:3", 0, script=script, rdzv=rdzv, host=names[r],
                       ELASTIC_KILLME="0") for r in (1, 2)]
        _wait(lambda: any("KILLME" in line for line in list(nodes[0].out)), 240,
              "node 0 at step 4 with 3 nodes", nodes)
        resumed = [line for line in list(nodes[0].out) if "RESUMED" in line]
        assert re.match(r"\[rank 0\] RESUMED step=\d world=3", resumed[-1]), resumed
        killed_at = nodes[0].kill()  # launcher and worker, SIGKILL
        survivors = nodes[1:]
        # Bound: node 0's lease runs out after the heartbeat timeout (etcd checks leases
        # every 0.5 s), + 0.5 s polling, + 1 s grace to stop the workers, + 2 s last call,
        # + 6 s for a loaded machine.
        bound = HEARTBEAT + 0.5 + 0.5 + 1 + 2 + 6
        left = re.compile(r"attempt (\d+): 2 nodes \[1, 2\]; left: \[0\]")
        _wait(lambda: all(any(left.search(line) for _, line in n.err) for n in survivors),
              bound + 60, "the next attempt announced", survivors)
        started = max(next(t for t, line in n.err if left.search(line)) for n in survivors)
        print(f"the next attempt started {started - killed_at:.1f} s after the kill")
        assert started - killed_at < bound, (started - killed_at, survivors[0].stderr())
        for n in survivors:
            assert n.proc.wait(timeout=240) == 0, n.stderr()[-3000:] + "".join(n.out)[-2000:]
        out = "".join(survivors[0].out)
        assert re.search(r"RESUMED step=0 world=[23] attempt=0", out), out
        # the newest complete checkpoint: step 4's, or step 2's when node 0 was killed while
        # step 4's asynchronous write was still being committed
        assert re.search(r"RESUMED step=(2|4) world=2 attempt=\d", out), out
        # node 1 leads now: it is rank 0
        assert [[line for line in n.out if "RESUMED" in line][-1][:8] for n in survivors] == [
            "[rank 0]", "[rank 1]"]
        assert_uninterrupted(tmp_path / "out.npz", steps)
    finally:
        for n in nodes:
            n.close()
