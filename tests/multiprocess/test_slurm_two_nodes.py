"""A real two-node Slurm: ``jpgnode0`` (192.0.2.1) and ``jpgnode1`` (192.0.2.2), each slurmd
in its own network namespace over a veth pair, slurmctld and the clients in the first, one
munged for both (``_cluster.two_node_slurm``; started once for this module). The node names
resolve only inside the namespaces, so jaxpg's Slurm detection finds the coordinator (the
first node of the step's node list) by name, and gloo crosses the veth pair.
"""

from __future__ import annotations

import re
import subprocess
import sys

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


SCRIPT = """\
#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
echo "BATCH $SLURMD_NODENAME $SLURM_JOB_NODELIST"
srun --label sh -c '{where}' {python} {worker} default world
"""


@pytest.mark.timeout(200)
def test_sbatch_on_two_nodes_its_srun_step_is_the_world(slurm2, tmp_path):
    """sbatch -N 2: the script runs on the first node; its srun step is a world of two,
    one rank per node."""
    script = tmp_path / "job.sh"
    script.write_text(SCRIPT.format(where=WHERE, python=sys.executable, worker=WORKER))
    out = tmp_path / "job.out"
    done = subprocess.run(slurm2.command("sbatch", "--wait", f"--output={out}", str(script)),
                          capture_output=True, text=True, timeout=150, env=slurm2.env)
    text = out.read_text() if out.exists() else ""
    assert done.returncode == 0, done.stdout + done.stderr + text + slurm2.logs()
    assert re.search(rf"^BATCH {TWO_NODES[0]} jpgnode\[0-1\]$", text, re.M), text
    lines = by_label(text)
    assert _nodes(lines) == {0: (TWO_NODES[0], HOST_ADDRESSES[0]),
                             1: (TWO_NODES[1], HOST_ADDRESSES[1])}, text
    for task in (0, 1):
        assert f"WORLD {task} 2 gloo local_rank=0" in lines[task], text
        assert "CHECK world_all_reduce ok" in lines[task] and "DONE" in lines[task], text
