"""A real one-node Slurm (munged, slurmctld, slurmd; started once per session by the
``slurm`` fixture): srun's tasks are jaxpg's world, never a world of one each; jaxpg-run
started by srun, one per node, makes one world of all its workers; an sbatch script is one
process and its srun steps are worlds; backend="mpi" runs under srun --mpi=pmix."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from _cluster import by_label, unavailable

WORKER = Path(__file__).parent / "workers" / "cluster_worker.py"
pytestmark = pytest.mark.slow

COLLECTIVES = {
    "all_reduce_sum_float32", "all_reduce_sum_float16", "all_reduce_max", "all_reduce_product",
    "all_reduce_bxor", "all_gather", "all_gather_uneven_float16", "all_gather_into_tensor",
    "reduce_scatter_tensor", "broadcast", "reduce", "gather", "scatter", "all_to_all_uneven",
    "all_to_all_single", "async_op", "all_gather_object", "broadcast_object_list",
    "scatter_object_list", "barriers", "new_subgroups_all_reduce", "spmd_all_reduce",
    "new_group_all_reduce", "batch_isend_irecv_ring", "send_recv",
}


@pytest.mark.timeout(400)
def test_srun_tasks_are_the_world_collectives_and_ddp(slurm):
    output = slurm.srun(["-n", "4", sys.executable, str(WORKER), "default", "collectives,ddp"])
    lines = by_label(output)
    assert sorted(lines) == [0, 1, 2, 3], output[-3000:]
    for task, text in lines.items():
        assert f"WORLD {task} 4 gloo local_rank={task}" in text, text[:5]
        checks = {m.group(1) for t in text if (m := re.match(r"CHECK (\w+) ok", t))}
        want = COLLECTIVES | {"ddp_step"}
        if task not in (0, 3):
            want.discard("new_group_all_reduce")
        if task != 3:
            want.discard("send_recv")  # checked by the receiver
        assert want <= checks, (task, sorted(want - checks))
        assert "DONE" in text


@pytest.mark.timeout(300)
def test_jaxpg_run_per_node_under_srun(slurm):
    """srun -n 2 jaxpg-run --nproc-per-node 2: two launchers (two "nodes" here), one world
    of four; node n's workers are ranks 2n and 2n + 1."""
    output = slurm.srun(["-n", "2", sys.executable, "-m", "jaxpg.run", "--nproc-per-node",
                         "2", str(WORKER), "default", "world"])
    lines = by_label(output)
    for node in (0, 1):
        text = "\n".join(lines[node])
        assert f"node {node} of 2" in text
        for rank in (2 * node, 2 * node + 1):
            assert f"[rank {rank}] WORLD {rank} 4 gloo local_rank={rank % 2}" in text, text
            assert f"[rank {rank}] CHECK world_all_reduce ok" in text
            assert f"[rank {rank}] DONE" in text


SCRIPT = """\
#!/bin/bash
#SBATCH --ntasks=2
#SBATCH --overcommit
show='import jaxpg as d; d.init_process_group(); print("SEES", d.get_rank(), d.get_world_size())'
{python} -c "$show"
srun --label {python} -c "$show"
"""


@pytest.mark.timeout(240)
def test_sbatch_script_is_one_process_and_its_srun_step_is_the_world(slurm, tmp_path):
    script = tmp_path / "job.sh"
    script.write_text(SCRIPT.format(python=sys.executable))
    out = tmp_path / "job.out"
    done = subprocess.run(slurm.command("sbatch", "--wait", f"--output={out}", str(script)),
                          capture_output=True, text=True, timeout=200, env=slurm.env)
    text = out.read_text() if out.exists() else ""
    assert done.returncode == 0, done.stdout + done.stderr + text + slurm.logs()
    assert re.search(r"^SEES 0 1$", text, re.M), text  # the batch script: one process
    assert sorted(re.findall(r"^\d+: SEES (\d) (\d)$", text, re.M)) == [("0", "2"), ("1", "2")]


@pytest.mark.timeout(300)
def test_mpi_backend_under_srun_pmix(slurm, mpiwrapper):
    plugins = subprocess.run(slurm.command("srun", "--mpi=list"), capture_output=True,
                             text=True, env=slurm.env, timeout=60)
    if "pmix" not in plugins.stdout + plugins.stderr:
        unavailable("this Slurm has no mpi/pmix plugin (srun --mpi=list)")
    output = slurm.srun(["--mpi=pmix", "-n", "2", sys.executable, str(WORKER), "mpi", "world"],
                        MPITRAMPOLINE_LIB=mpiwrapper)
    lines = by_label(output)
    for task in (0, 1):
        assert f"WORLD {task} 2 mpi local_rank={task}" in lines[task]
        assert "CHECK world_all_reduce ok" in lines[task] and "DONE" in lines[task]
