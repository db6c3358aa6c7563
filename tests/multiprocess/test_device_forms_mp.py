"""Every API that takes devices accepts the documented forms alike across 2 processes with
one device each (the one-process layout is tests/test_device_forms.py)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "workers" / "device_forms_worker.py"
CHECKS = {"collectives", "spmd_mesh", "ddp_group_mesh_dp", "ddp_device_mesh",
          "fsdp_parallel_dims", "tp_mesh", "tp_parallel_dims", "pipeline_device_mesh",
          "pipeline_parallel_dims"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_device_forms_across_two_processes():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", "2", str(WORKER)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    found = {}
    for m in re.finditer(r"\[rank (\d+)\] CHECK (\w+) ok", proc.stdout):
        found.setdefault(int(m.group(1)), set()).add(m.group(2))
    assert found == {0: CHECKS, 1: CHECKS}, proc.stdout[-4000:]
