"""examples/moe_gpt.py, briefly: a MoE GPT with ep=2 x dp=2 on 4 simulated devices against
one-device training (dropless)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from _child_env import child_env

EXAMPLE = Path(__file__).parents[2] / "examples" / "moe_gpt.py"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_moe_gpt_ep2_dp2_matches_one_device_training():
    env = child_env()
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, str(EXAMPLE), "--steps", "8", "--layers", "1", "--dim", "16",
           "--seq", "8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=580, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = re.search(r"RESULT after 8 steps: loss ([\d.]+), one device ([\d.]+), \|difference\| "
                  r"(\S+) <= 0\.0001: OK \(dp=2 x ep=2, 4 experts, 2 per rank\)", proc.stdout)
    assert m, proc.stdout[-3000:]
    first = float(re.search(r"step 0: loss ([\d.]+)", proc.stdout).group(1))
    assert float(m.group(1)) < first  # it learned
    assert abs(float(m.group(1)) - float(m.group(2))) <= 1e-4
