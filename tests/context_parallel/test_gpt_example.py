"""examples/gpt_context_parallel.py, briefly: dp=2 x cp=2 x tp=2 on 8 simulated devices (ring
attention, load-balanced causal layout) against one-device training."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from _child_env import child_env

EXAMPLE = Path(__file__).parents[2] / "examples" / "gpt_context_parallel.py"


@pytest.mark.timeout(600)
def test_gpt_dp_cp_tp_matches_one_device_training():
    env = child_env()
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, str(EXAMPLE), "--steps", "20", "--layers", "1", "--seq", "16",
           "--cp", "2", "--tp", "2", "--dp", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=580, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"RESULT dp=2 x cp=2 x tp=2 \(ring\), 1 process\(es\), after 20 steps: "
                     r"\|difference\| \S+ <= 0\.0001: OK", proc.stdout), proc.stdout[-3000:]
    losses = [float(m) for m in re.findall(r"step +\d+  loss ([\d.]+)", proc.stdout)]
    assert len(losses) == 5 and losses[-1] < losses[0] - 0.3  # it learned
