"""Tensor parallelism with one rank per process: 4 real processes under jaxpg-run.

One launch serves both tests (module fixture): the Paddle layers at tp=4, the
vocabulary-parallel loss at tp=2, and DDP over "dp" of a sequence-parallel block over "tp"
on a 2 x 2 mesh, against local references, and,
with torch installed, torch's parallelize_module trained on the same weights and data.
"""

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _child_env import child_env
from _require import import_or_skip

WORKER = Path(__file__).parent / "workers" / "tp_worker.py"
CHECKS = {"init_slices_tp4", "paddle_mlp_spmd_tp4", "paddle_host_local_output",
          "vocab_parallel_cross_entropy_tp2", "ddp_dp2_sequence_parallel_block_tp2"}
TORCH_CHECK = "torch_parallelize_module_6_sgd_steps_tp4"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def launch():
    env = child_env()
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", "4", str(WORKER),
           str(_free_port())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=840, env=env)
    found: dict[int, set[str]] = {}
    for m in re.finditer(r"\[rank (\d+)\] CHECK (\w+) ok", proc.stdout):
        found.setdefault(int(m.group(1)), set()).add(m.group(2))
    return proc, found


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_layers_block_loss_and_ddp_with_one_rank_per_process(launch):
    proc, found = launch
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert {r: c - {TORCH_CHECK} for r, c in found.items()} == {r: CHECKS for r in range(4)}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_parameters_equal_torch_parallelize_module_after_6_sgd_steps(launch):
    import_or_skip("torch", "no torch reference to compare with (pip install torch==2.13.0)")
    proc, found = launch
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert all(TORCH_CHECK in found.get(r, set()) for r in range(4)), proc.stdout[-4000:]
