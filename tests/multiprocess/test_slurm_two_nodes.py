"""A real two-node Slurm: ``jpgnode0`` (192.0.2.1) and ``jpgnode1`` (192.0.2.2), each slurmd
in its own network namespace over a veth pair, slurmctld and the clients in the first, one
munged for both (``_cluster.two_node_slurm``; started once for this module). The node names
resolve only inside the namespaces, so jaxpg's Slurm detection finds the coordinator (the
first node of the step's node list) by name, and gloo crosses the veth pair. The batch
scripts are docs/cluster.md's own, read from the page (two tasks or workers per node
instead of four, no GPU lines, the worker instead of ``train.py``).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from _cluster import TWO_NODES, by_label, two_node_slurm
from _netns import HOST_ADDRESSES
from test_slurm import COLLECTIVES, WORKER

pytestmark = pytest.mark.slow

# Each task first says where it runs: its Slurm node and its network's addresses.
WHERE = 'echo "NODE $SLURMD_NODENAME $(hostname -I)"; exec "$0" "$@"'


@pytest.fixture(scope="module")
def slurm2(tmp_path_factory):
    with two_node_slurm(tmp_path_factory.mktemp("slurm2")) as cluster:
        yield cluster


def _nodes(lines: dict[int, list[str]]) -> dict[int, tuple[str, str]]:
    """Each task's (node, address) from its ``NODE`` line."""
    found = {}
    for task, text in lines.items():
        for line in text:
            if m := re.fullmatch(r"NODE (\S+) (\S+)\s*", line):
                found[task] = (m.group(1), m.group(2))
    return found


@pytest.mark.timeout(240)
def test_srun_on_two_nodes_is_one_world_collectives(slurm2):
    """srun -N 2 --ntasks-per-node 1: rank 0 on jpgnode0, rank 1 on jpgnode1, each world
    from Slurm's variables alone; every collective against numpy over both ranks."""
    output = slurm2.srun(["-N", "2", "--ntasks-per-node", "1", "sh", "-c", WHERE,
                          sys.executable, str(WORKER), "default", "collectives"], timeout=200)
    lines = by_label(output)
    assert sorted(lines) == [0, 1], output[-3000:]
    assert _nodes(lines) == {0: (TWO_NODES[0], HOST_ADDRESSES[0]),
                             1: (TWO_NODES[1], HOST_ADDRESSES[1])}, output[-3000:]
    for task, text in lines.items():
        assert f"WORLD {task} 2 gloo local_rank=0" in text, text[:5]
        checks = {m.group(1) for t in text if (m := re.match(r"CHECK (\w+) ok", t))}
        want = COLLECTIVES - ({"send_recv"} if task == 0 else set())  # checked by rank 1
        assert want <= checks, (task, sorted(want - checks))
        assert "DONE" in text


DOCS = Path(__file__).resolve().parents[2] / "docs" / "cluster.md"


def docs_script(marker: str) -> str:
    """The ```bash block of docs/cluster.md's Slurm section that holds ``marker``."""
    blocks = re.findall(r"```bash\n(.*?)```", DOCS.read_text(), re.S)
    found = [b for b in blocks if "#SBATCH" in b and marker in b]
    assert len(found) == 1, (marker, found)
    return found[0]


def for_this_cluster(script: str, srun_command: str, run: str) -> str:
    """A docs script made to run here: two tasks (or workers) per node on these CPU nodes
    (the docs' ``4``), no GPU lines, this Python for ``python``/``jaxpg-run``, and its
    training command ``srun_command`` replaced by ``run``."""
    lines = [line for line in script.splitlines() if "--gpus-per" not in line]
    script = "\n".join(lines) + "\n"
    script = script.replace("--ntasks-per-node=4", "--ntasks-per-node=2")
    assert srun_command in script, (srun_command, script)
    return script.replace(srun_command, run)


def sbatch(slurm2, tmp_path, script: str, timeout: float) -> str:
    path = tmp_path / "job.sh"
    path.write_text(script)
    out = tmp_path / "job.out"
    done = subprocess.run(slurm2.command("sbatch", "--wait", f"--output={out}", str(path)),
                          capture_output=True, text=True, timeout=timeout, env=slurm2.env)
    text = out.read_text() if out.exists() else ""
    assert done.returncode == 0, done.stdout + done.stderr + text + slurm2.logs()
    return text


@pytest.mark.timeout(300)
def test_docs_sbatch_script_trains_ddp_on_two_nodes_of_two_tasks(slurm2, tmp_path):
    """docs/cluster.md's first script (``srun python train.py``, 2 nodes, here 2 tasks
    each): the script runs on the first node; its srun step is a world of four, two ranks
    per node, whose DDP steps equal one-process training on the whole batch."""
    script = for_this_cluster(
        docs_script("srun python train.py"), "srun python train.py",
        f"echo \"BATCH $SLURMD_NODENAME $SLURM_JOB_NODELIST\"\n"
        f"srun --label sh -c '{WHERE}' {sys.executable} {WORKER} default ddp")
    text = sbatch(slurm2, tmp_path, script, 250)
    assert re.search(rf"^BATCH {TWO_NODES[0]} jpgnode\[0-1\]$", text, re.M), text
    lines = by_label(text)
    assert _nodes(lines) == {0: (TWO_NODES[0], HOST_ADDRESSES[0]),
                             1: (TWO_NODES[0], HOST_ADDRESSES[0]),
                             2: (TWO_NODES[1], HOST_ADDRESSES[1]),
                             3: (TWO_NODES[1], HOST_ADDRESSES[1])}, text
    for task in range(4):
        assert f"WORLD {task} 4 gloo local_rank={task % 2}" in lines[task], text
        assert "CHECK ddp_step ok" in lines[task] and "DONE" in lines[task], text


@pytest.mark.timeout(300)
def test_docs_sbatch_script_with_jaxpg_run_per_node_trains_fsdp(slurm2, tmp_path):
    """docs/cluster.md's second script (``srun jaxpg-run --nproc-per-node 4
    --max-restarts 3 train.py``, one launcher per node, here 2 workers each): the launchers
    take their nodes from the step and make one world of four, whose FSDP steps equal
    one-process training on the whole batch."""
    command = "srun jaxpg-run --nproc-per-node 4 --max-restarts 3 train.py"
    script = for_this_cluster(
        docs_script(command), command,
        f"srun {sys.executable} -m jaxpg.run --nproc-per-node 2 --max-restarts 3 "
        f"{WORKER} default fsdp")
    text = sbatch(slurm2, tmp_path, script, 250)
    ranks = {int(m.group(1)): m.group(2) for m in re.finditer(
        r"^\[rank (\d+)\] (WORLD .*)$", text, re.M)}
    assert ranks == {r: f"WORLD {r} 4 gloo local_rank={r % 2}" for r in range(4)}, text
    assert len(re.findall(r"^\[rank \d\] CHECK fsdp_step ok$", text, re.M)) == 4, text
    assert "[jaxpg-run] started by slurm" in text and "node 1 of 2" in text, text
