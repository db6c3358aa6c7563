"""Two hosts (network namespaces over a veth pair), two workers each, gloo across them.

Each namespace runs ``jaxpg-run --nnodes 2 --node-rank I --master-addr 192.0.2.1`` with
``collectives_worker.py``: every collective against numpy, a sub-group [0, 3] spanning both
hosts, and send/recv from rank 0 (host 0) to rank 3 (host 1). The hostname resolves to
127.0.0.1 here, so gloo must take the address of the route to the master instead.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _child_env import child_env
from _cluster import unavailable
from _netns import HOST_ADDRESSES, two_hosts, why_no_namespaces

from jaxpg.runtime.gloo_interface import GlooDevice, choose_gloo_device

WORKERS = Path(__file__).parent / "workers"


def test_gloo_device_choice():
    assert choose_gloo_device("10.1.1.1", {"GLOO_SOCKET_IFNAME": "lo,eth9"}) == GlooDevice(
        interface="lo", reason="GLOO_SOCKET_IFNAME"
    )
    with pytest.raises(ValueError, match="GLOO_SOCKET_IFNAME='nosuch0'.*no interface"):
        choose_gloo_device("10.1.1.1", {"GLOO_SOCKET_IFNAME": "nosuch0"})
    own = socket.gethostbyname(socket.gethostname())
    chosen = choose_gloo_device("127.0.0.1", {})
    if own.startswith("127."):  # this machine: the route to the master decides
        assert chosen.hostname == "127.0.0.1" and "route to 127.0.0.1" in chosen.reason
    else:
        assert chosen.hostname == own


def _launch(ns: str, node_rank: int, port: int, flags: list[str] = (),
            script: Path = WORKERS / "collectives_worker.py", *script_args: str,
            **extra_env: str) -> subprocess.Popen:
    env = child_env()
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **extra_env)
    command = [
        "ip", "netns", "exec", ns, sys.executable, "-m", "jaxpg.run", "--nnodes", "2",
        "--node-rank", str(node_rank), "--master-addr", HOST_ADDRESSES[0], "--master-port",
        str(port), "--nproc-per-node", "2", *flags, str(script), *script_args,
    ]  # fmt: skip
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _require_namespaces() -> None:
    reason = why_no_namespaces()
    if reason is not None:
        # Issue 10 allows this skip only where namespaces cannot be made (no root, no
        # iproute2); CI runs as root with JAXPG_REQUIRE_CLUSTER_TESTS=1, where it fails.
        unavailable(f"cannot make network namespaces: {reason}")


def _communicate_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    """Each launcher's (stdout, stderr); any still running afterwards is killed."""
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_hosts_run_every_collective_through_gloo():
    _require_namespaces()
    with two_hosts() as hosts:
        procs = [_launch(ns, i, 29611) for i, ns in enumerate(hosts)]
        outputs = _communicate_all(procs, 240)
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:] + err[-3000:]
    stdout = "".join(out for out, _ in outputs)
    found: dict[int, set[str]] = {}
    for m in re.finditer(r"\[rank (\d+)\] CHECK (\w+) ok", stdout):
        found.setdefault(int(m.group(1)), set()).add(m.group(2))
    assert sorted(found) == [0, 1, 2, 3]
    for rank, checks in found.items():
        assert {"all_reduce_sum", "subgroup_all_reduce", "all_gather_uneven", "all_to_all_uneven",
                "reduce_scatter_tensor", "broadcast", "batch_isend_irecv_ring",
                "spmd_all_reduce", "barriers"} <= checks, (rank, checks)
    assert {"recv_unknown_shape", "recv_several"} <= found[3]  # sent from host 0 to host 1
    assert stdout.count("DONE") == 4


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_hosts_restart_together_after_a_failure_on_one(tmp_path):
    _require_namespaces()
    with two_hosts() as hosts:
        procs = [_launch(ns, i, 29612, ["--max-restarts", "1", "--grace-period", "1"],
                         WORKERS / "fail_first_attempt.py", str(tmp_path), "1", SLEEP_S="4")
                 for i, ns in enumerate(hosts)]
        outputs = _communicate_all(procs, 180)
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:] + err[-3000:]
    assert "rank 3 exited with code 3" in outputs[1][1]
    assert "rank 3 exited with code 3 (on another node)" in outputs[0][1]
    envs = [json.loads(line.split("ENV ", 1)[1]) for out, _ in outputs
            for line in out.splitlines() if "ENV " in line]
    assert len(envs) == 8  # 4 ranks x 2 attempts, on both hosts
    for attempt in "01":
        group = [e for e in envs if e["TORCHELASTIC_RESTART_COUNT"] == attempt]
        assert sorted(int(e["RANK"]) for e in group) == [0, 1, 2, 3]
        assert {e["MASTER_ADDR"] for e in group} == {HOST_ADDRESSES[0]}
        assert len({e["MASTER_PORT"] for e in group}) == 1  # both hosts: the same coordinator
    assert len({e["TORCHELASTIC_RUN_ID"] for e in envs}) == 1
    assert {e["MASTER_PORT"] for e in envs if e["TORCHELASTIC_RESTART_COUNT"] == "0"} != {
        e["MASTER_PORT"] for e in envs if e["TORCHELASTIC_RESTART_COUNT"] == "1"}



@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_hosts_must_agree_on_their_settings(tmp_path):
    _require_namespaces()
    with two_hosts() as hosts:
        procs = [_launch(ns, i, 29614, ["--max-restarts", str(i)],
                         WORKERS / "fail_first_attempt.py", str(tmp_path))
                 for i, ns in enumerate(hosts)]
        outputs = _communicate_all(procs, 90)
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 2, err
        assert "--max-restarts is 1 on node 1 but 0 on node 0" in err
        assert "ENV" not in out  # no worker started
