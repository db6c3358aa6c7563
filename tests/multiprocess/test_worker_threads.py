"""jaxpg-run's per-worker CPU thread settings: OMP_NUM_THREADS and the CPU pinning."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jaxpg.run import worker_env
from jaxpg.run.env import AFFINITY_VAR, cpu_slice

COMMON = dict(world_size=4, node_rank=0, master_addr="127.0.0.1", master_port=1)


def envs(base: dict[str, str], n: int, **kw) -> list[dict[str, str]]:
    return [worker_env(dict(base), rank=r, local_rank=r, local_world_size=n, **{**COMMON, **kw})
            for r in range(n)]


def test_cpu_slices_split_the_cpus_or_share_them_round_robin():
    assert [cpu_slice(r, 2, [0, 1, 2, 3]) for r in range(2)] == [[0, 1], [2, 3]]
    assert [cpu_slice(r, 3, range(8)) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert [cpu_slice(r, 4, [0, 1]) for r in range(4)] == [[0], [1], [0], [1]]


def test_cpu_workers_get_disjoint_cpus_and_omp_threads_per_slice():
    cpus = sorted(os.sched_getaffinity(0))
    n = 2
    got = envs({}, n)
    slices = [[int(c) for c in e[AFFINITY_VAR].split(",")] for e in got]
    assert slices == [cpu_slice(r, n, cpus) for r in range(n)]  # naive reference
    if len(cpus) >= n:
        assert not set(slices[0]) & set(slices[1])
    assert [int(e["OMP_NUM_THREADS"]) for e in got] == [len(s) for s in slices]


def test_the_users_thread_settings_win_and_gpu_or_single_workers_are_not_pinned():
    got = envs({"OMP_NUM_THREADS": "7", AFFINITY_VAR: "none"}, 2)
    assert all(e["OMP_NUM_THREADS"] == "7" and e[AFFINITY_VAR] == "none" for e in got)
    assert AFFINITY_VAR not in envs({}, 1)[0]
    assert AFFINITY_VAR not in envs({}, 2, gpus=["0", "1"])[0]
    with pytest.raises(ValueError, match="JAXPG_CPU_AFFINITY='x'"):
        envs({AFFINITY_VAR: "x"}, 2)


@pytest.mark.slow
# os.sched_getaffinity, which jaxpg-run's pinning uses and this test reads, exists only on
# Linux; elsewhere the launcher does not pin, so there is nothing to check.
@pytest.mark.skipif(sys.platform != "linux", reason="CPU affinity is Linux-only")
def test_a_started_worker_runs_on_its_slice(tmp_path):
    # through the launcher in a subprocess: forking this (JAX-threaded) pytest process for
    # the pre-exec hook would warn
    cpus = sorted(os.sched_getaffinity(0))
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os\n"
        "print('CPUS', sorted(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in (AFFINITY_VAR, "OMP_NUM_THREADS")}
    cmd = [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", "2", str(probe)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    for r in range(2):
        mine = cpu_slice(r, 2, cpus)
        assert f"[rank {r}] CPUS {mine} {len(mine)}" in out.stdout, out.stdout + out.stderr
