"""Cases from PyTorch's own distributed tests (test_c10d_gloo.py, test_c10d_common.py,
test_c10d_object_collectives.py, distributed_test.py), run by jaxpg and by torch gloo in
the same processes on the same inputs, world 2 and 3: one launch per world size.

Each case checks both against the numpy expectation over every rank's inputs
(``workers/c10d_conformance_worker.py``); where torch is not installed, jaxpg alone.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "workers" / "c10d_conformance_worker.py"
CASES = set(re.findall(r"^def (\w+)\(\):", WORKER.read_text(), re.M))
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_torch_c10d_cases(world):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", JAXPG_TORCH_PORT=str(_free_port()))
    cmd = [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", str(world), str(WORKER)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    with_torch = importlib.util.find_spec("torch") is not None
    for rank in range(world):
        ours = set(re.findall(rf"\[rank {rank}\] CHECK (\w+) ok", proc.stdout))
        assert ours == CASES, (rank, CASES - ours)
        if with_torch:
            theirs = set(re.findall(rf"\[rank {rank}\] TORCH (\w+) ok", proc.stdout))
            assert theirs == CASES, (rank, CASES - theirs)
    assert proc.stdout.count("DONE") == world
