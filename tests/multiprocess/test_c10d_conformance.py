"""Cases from PyTorch's own distributed tests (test_c10d_gloo.py, test_c10d_common.py,
test_c10d_object_collectives.py, distributed_test.py), run by jaxpg and by torch gloo in
the same processes on the same inputs, world 2 and 3: one launch per world size.

Each case checks both against the numpy expectation over every rank's inputs
(``workers/c10d_conformance_worker.py``); where torch is not installed, jaxpg alone, unless
``JAXPG_REQUIRE_TORCH=1`` (CI's 3.11 leg), where that fails.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _require import TORCH, required

from jaxpg.internal import free_port

WORKER = Path(__file__).parent / "workers" / "c10d_conformance_worker.py"
CASES = set(re.findall(r"^def (\w+)\(\):", WORKER.read_text(), re.M))
pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_torch_c10d_cases(world):
    with_torch = importlib.util.find_spec("torch") is not None
    assert with_torch or not required(TORCH), \
        f"{TORCH}=1, but torch is not installed: its own run of the cases is the reference"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", JAXPG_TORCH_PORT=str(free_port()))
    cmd = [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", str(world), str(WORKER)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    for rank in range(world):
        ours = set(re.findall(rf"\[rank {rank}\] CHECK (\w+) ok", proc.stdout))
        assert ours == CASES, (rank, CASES - ours)
        if with_torch:
            theirs = set(re.findall(rf"\[rank {rank}\] TORCH (\w+) ok", proc.stdout))
            assert theirs == CASES, (rank, CASES - theirs)
    assert proc.stdout.count("DONE") == world
