"""DDP across 2 real processes (one rank each) under jaxpg-run."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "workers" / "ddp_worker.py"
CHECKS = {"equals_reference", "loss_is_global_mean", "checkpoint_resume", "join_uneven_inputs",
          "throw_on_early_termination", "shape_mismatch_named"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_across_two_processes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", "2", str(WORKER),
           str(tmp_path / "ckpt")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    found = {}
    for m in re.finditer(r"\[rank (\d+)\] CHECK (\w+) ok", proc.stdout):
        found.setdefault(int(m.group(1)), set()).add(m.group(2))
    assert found == {0: CHECKS, 1: CHECKS}, proc.stdout[-4000:]
