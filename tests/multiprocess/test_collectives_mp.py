"""Every collective across real processes on 127.0.0.1, against numpy; init methods;
a worker that never arrives and a worker that dies raise instead of hanging."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _child_env import xla_flags
from _procs import finish

WORKERS = Path(__file__).parent / "workers"
pytestmark = pytest.mark.slow

CHECKS_ONE_RANK = {
    "all_reduce_sum", "all_reduce_bxor", "subgroup_all_reduce", "all_gather",
    "all_gather_uneven", "all_gather_into_tensor", "all_to_all_single_even",
    "reduce_scatter_tensor", "broadcast",
    "reduce", "gather", "scatter", "all_to_all_uneven", "all_to_all_single_uneven",
    "batch_isend_irecv_ring", "all_gather_object", "broadcast_object_list",
    "scatter_object_list", "spmd_all_reduce", "barriers", "async_op",
}
# A process with several devices (ranks) runs the list-of-arrays all_to_all instead of the
# one-array-per-process forms and point-to-point.
CHECKS_SEVERAL_RANKS = CHECKS_ONE_RANK - {
    "all_to_all_uneven", "all_to_all_single_uneven", "all_to_all_single_even",
    "batch_isend_irecv_ring",
} | {"all_to_all_stacked"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", **extra)
    return env


def _checks_by_rank(stdout: str) -> dict[int, set[str]]:
    found: dict[int, set[str]] = {}
    for m in re.finditer(r"\[rank (\d+)\] CHECK (\w+) ok", stdout):
        found.setdefault(int(m.group(1)), set()).add(m.group(2))
    return found


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc,devices", [(2, 1), (4, 1), (2, 2)], ids=["2x1", "4x1", "2x2"])
def test_every_collective_across_processes(nproc, devices):
    cmd = [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", str(nproc),
           "--devices-per-proc", str(devices), str(WORKERS / "collectives_worker.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=_env())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    found = _checks_by_rank(proc.stdout)
    assert sorted(found) == list(range(nproc))
    for rank, checks in found.items():  # every check of its kind, each passed
        want = set(CHECKS_ONE_RANK if devices == 1 else CHECKS_SEVERAL_RANKS)
        if rank == nproc - 1 and devices == 1:
            want |= {"recv_unknown_shape", "recv_several"}
        assert checks == want, (rank, want - checks, checks - want)
    assert proc.stdout.count("DONE") == nproc


def _spawn(script: Path, args: list[str], n: int, extra_env: dict[str, str] | None = None,
           launcher_env: bool = False, port: int | None = None) -> list[subprocess.Popen]:
    procs = []
    for r in range(n):
        env = _env(XLA_FLAGS=xla_flags(1),
                   JAXPG_TEST_RANK=str(r), JAXPG_TEST_WORLD=str(n), **(extra_env or {}))
        if launcher_env:
            env.update(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["env", "tcp", "file"])
def test_init_methods_and_reinit_after_destroy(method, tmp_path):
    port = _free_port()
    if method == "env":
        args = ["env://", "env://"]
    elif method == "tcp":
        args = [f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{_free_port()}"]
    else:
        args = [f"file://{tmp_path / 'rdzv1'}", f"file://{tmp_path / 'rdzv2'}"]
    procs = _spawn(WORKERS / "init_worker.py", args, 2, launcher_env=method == "env", port=port)
    results = finish(procs, 90)
    for code, text in results:
        assert code == 0, text[-3000:]
        assert "RESULT 0 [1.0, 1.0]" in text and "RESULT 1 [3.0, 3.0]" in text, text[-2000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["never_arrives", "killed"])
def test_missing_worker_raises_within_timeout(mode, tmp_path):
    port = _free_port()
    procs = _spawn(WORKERS / "absent_worker.py", [mode, str(tmp_path / "raised")], 2,
                   launcher_env=True, port=port)
    results = finish(procs, 90)
    code0, text0 = results[0]
    assert code0 == 17, text0[-3000:]
    m = re.search(r"raised after ([\d.]+) s: (.*)", text0)
    assert m, text0[-3000:]
    assert float(m.group(1)) < 3.0 + 27.0  # the group's 3 s timeout, and a loaded machine
    assert "ranks that did not arrive: [1]" in m.group(2)
    want = "DistTimeoutError" if mode == "never_arrives" else "Dist"
    assert m.group(2).startswith(want)
    assert "all_reduce #1 on group 'group1'" in m.group(2)
