"""``moe`` with one rank per process: 4 real processes under jaxpg-run, one launch.

Against the one-device reference (output, the four gradients, aux loss, counts, drops):
ep = 4 (the world) with top_k 2 and a capacity, ep = 2 (a ("dp", "ep") mesh's dimension) with
top_k 1 dropless (each routing option is checked alone in process, in test_moe.py, on
simulated devices: one launch of 4 processes costs about 35 CPU s per case); also the host-code call
with plain local arrays, the error for expert shapes that differ across ranks, and
``DistributedDataParallel(..., expert_axes=("ep",))`` over the (dp, ep) world against
one-device SGD.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from _child_env import child_env

WORKER = Path(__file__).parent / "workers" / "moe_worker.py"
CHECKS = {"ep4_top2_capacity", "ep2_top1_dropless", "host_call", "mismatched_shapes_error",
          "ddp_expert_axes"}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_moe_across_processes_equals_the_one_device_reference():
    env = child_env()
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", "4", str(WORKER)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=840, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    found: dict[int, set[str]] = {}
    for m in re.finditer(r"\[rank (\d+)\] CHECK (\w+) ok", proc.stdout):
        found.setdefault(int(m.group(1)), set()).add(m.group(2))
    assert found == {r: CHECKS for r in range(4)}, proc.stdout[-4000:]
