"""FSDP across 2 real processes (one rank each) under jaxpg-run, and checkpoints moving
between 4 ranks in one process and 2 processes."""

import re
import subprocess
import sys
from pathlib import Path

import optax
import pytest
from _child_env import child_env
from _fsdp_models import Block, Net, Reference, assert_trees_close, group, loss_fn, make_batches
from _require import import_or_skip

from jaxpg.fsdp import FullyShardedDataParallel
from jaxpg.fsdp.checkpoint import restore_checkpoint, save_checkpoint

WORKER = Path(__file__).parent / "workers" / "fsdp_worker.py"
TORCH_WORKER = Path(__file__).parent / "workers" / "torch_fsdp2_worker.py"
CHECKS = {"stage1_reshard_fp32", "stage2_reshard_fp32", "stage3_reshard_fp32",
          "stage3_keep_bf16",
          "resume_from_4_ranks", "holds_its_shard", "saved_sharded", "damaged_newest_skipped",
          "pipeline_zero2_over_dp", "pipeline_zero3_over_dp", "group_without_this_process",
          "shape_mismatch_named"}
OPT = optax.sgd(0.5, momentum=0.9)  # linear in the gradient: a wrong average shows


def launch(worker, *args, timeout=360):
    env = child_env()
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", "2", str(worker), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    found = {}
    for m in re.finditer(r"\[rank (\d+)\] CHECK (\w+) ok", proc.stdout):
        found.setdefault(int(m.group(1)), set()).add(m.group(2))
    return found, proc.stdout, proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_fsdp_across_two_processes(world, tmp_path):
    fsdp = FullyShardedDataParallel(Net(0), OPT, group=group(4), units=Block)
    for batch in make_batches(3, 16):
        fsdp.train_step(loss_fn, batch)
    save_checkpoint(tmp_path / "ckpt4", fsdp, data_state={"batch": 3})

    found, out, err = launch(WORKER, str(tmp_path))
    assert found == {0: CHECKS, 1: CHECKS}, out[-4000:]
    # processes that used orbax end cleanly: no absl "meta" lines, no asyncio tracebacks
    for text in ("Traceback", "Event loop is closed", "could not be restored"):
        assert text not in err, err[-4000:]

    # the 2 processes' checkpoint, resumed by 4 ranks here (step 6, cut, is skipped)
    resumed = FullyShardedDataParallel(Net(3), OPT, group=group(4), units=Block)
    with pytest.warns(UserWarning, match=r"step=6: array file"):
        assert restore_checkpoint(tmp_path / "ckpt2", resumed) == (5, {"batch": 5})
    last = make_batches(1, 16, seed=11)
    resumed.train_step(loss_fn, last[0])
    ref = Reference(Net(0), OPT)
    for batch in make_batches(3, 16) + make_batches(2, 8, seed=7) + last:
        ref.step(batch)
    assert_trees_close(resumed.full_params(), ref.params)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_parameters_equal_torch_fsdp2_after_6_sgd_steps():
    import_or_skip("torch", "torch (CPU) is the reference FSDP2 implementation")
    found, out, _ = launch(TORCH_WORKER, str(_free_port()), timeout=280)
    assert found == {0: {"equal_to_torch_fsdp2"}, 1: {"equal_to_torch_fsdp2"}}, out[-4000:]
