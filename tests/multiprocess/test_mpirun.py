"""Open MPI's mpirun starts the world, with gloo (2 processes) and with backend="mpi" (XLA's
MPI collectives through MPIwrapper; 2 and 4 processes): every rank sees mpirun's world, every
collective matches numpy, a DDP step matches one-process training, a pipeline step matches
the un-pipelined model, and every process exits 0 (no abort at MPI_Finalize)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from _cluster import clean_env, missing_programs, mpirun_command, unavailable

WORKER = Path(__file__).parent / "workers" / "cluster_worker.py"
pytestmark = pytest.mark.slow

CHECKS = {
    "all_reduce_sum_float32", "all_reduce_sum_bfloat16", "all_reduce_sum_float16",
    "all_reduce_max", "all_reduce_min", "all_reduce_product", "all_reduce_avg",
    "all_reduce_bxor", "all_reduce_bool", "all_gather", "all_gather_uneven_float16",
    "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "reduce", "gather",
    "scatter", "all_to_all_uneven", "all_to_all_single", "async_op", "all_gather_object",
    "broadcast_object_list", "scatter_object_list", "barriers", "new_subgroups_all_reduce",
    "spmd_all_reduce", "batch_isend_irecv_ring", "ddp_step", "pipeline_step",
}
# XLA's MPI communicators need every process: what leaves some out must say so
UNSUPPORTED_MPI = {"new_group", "batch_isend_irecv", "send_recv"}


_CHUNK = re.compile(r"\[\d+,(\d+)\]<std(?:out|err)>:(.*?)(?=\[\d+,\d+\]<std(?:out|err)>:|\Z)",
                    re.S)


def by_rank(output: str) -> dict[int, list[str]]:
    """Each rank's lines from mpirun --tag-output, which tags every chunk a rank writes
    (``[1,3]<stdout>:text``), so one rank's line may be cut by another's chunk: the chunks
    are joined per rank first."""
    streams: dict[int, str] = {}
    for m in _CHUNK.finditer(output):
        streams[int(m.group(1))] = streams.get(int(m.group(1)), "") + m.group(2)
    return {rank: text.splitlines() for rank, text in streams.items()}


def run_mpirun(n: int, backend: str, extra_env: dict[str, str], timeout: float = 360,
               args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    if missing_programs("mpirun"):
        unavailable("mpirun is not installed (apt-get install openmpi-bin)")
    env = clean_env(**extra_env)
    cmd = [*mpirun_command(n, env=env, forward=["PYTHONUNBUFFERED", "JAX_PLATFORMS",
                                                   *extra_env]),
           sys.executable, str(WORKER), backend, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("backend, n", [
    ("gloo", 2),  # mpirun's world read from OMPI_COMM_WORLD_*; gloo at 4 processes is
                  # test_collectives_mp.py's [4x1] case, under jaxpg-run
    ("mpi", 2),
    ("mpi", 4),   # XLA's MPI collectives and the sub-group refusals need more than 2
])  # fmt: skip
def test_mpirun_world_collectives_ddp_pipeline(n, backend, request):
    extra = {}
    if backend == "mpi":
        extra["MPITRAMPOLINE_LIB"] = request.getfixturevalue("mpiwrapper")
    proc = run_mpirun(n, backend, extra)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "MPI_Comm_free" not in output and "has been aborted" not in output, output[-3000:]
    lines = by_rank(output)
    assert sorted(lines) == list(range(n)), output[-3000:]
    for rank, text in lines.items():
        assert f"WORLD {rank} {n} {backend} local_rank=-" in text, text[:5]
        checks = {m.group(1) for t in text if (m := re.match(r"CHECK (\w+) ok", t))}
        unsupported = {m.group(1) for t in text if (m := re.match(r"UNSUPPORTED (\w+)", t))}
        want = set(CHECKS) | ({"mpi_wrong_thread"} if backend == "mpi" else set())
        if n % 2:
            want.discard("new_subgroups_all_reduce")
        if backend == "mpi" and n > 2:
            sends = {"send_recv"} if rank in (0, n - 1) else set()
            group = {"new_group"} if rank in (0, n - 1) else set()
            assert unsupported == {"batch_isend_irecv"} | sends | group, (rank, unsupported)
            want -= UNSUPPORTED_MPI | {"batch_isend_irecv_ring"}
        else:
            assert not unsupported, (rank, unsupported)
        assert want <= checks, (rank, sorted(want - checks))
        assert "DONE" in text


@pytest.mark.timeout(240)
def test_mpi_backend_needs_every_process_started_by_mpirun(mpiwrapper):
    """Workers of jaxpg-run cannot share MPI (each is a world of one to MPI): refused by
    name at init_process_group, not a hang."""
    env = clean_env(MPITRAMPOLINE_LIB=mpiwrapper)
    cmd = [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", "2", str(WORKER), "mpi",
           "none"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "MPI sees this process as rank 0 of 1, but the world has 2 processes" in output, \
        output[-3000:]
