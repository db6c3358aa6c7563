"""Asynchronous checkpoints (DDP and FSDP): training goes on while orbax writes, each
checkpoint holds the state of its step (not a later one: the step donates the buffers), the
next save waits for the previous one, and a process killed while a checkpoint is written
leaves the previous one complete and loadable."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest
from _fsdp_models import Block, Net, Reference, assert_trees_close, group, loss_fn, make_batches

from jaxpg import ddp as jddp
from jaxpg import fsdp as jfsdp
from jaxpg.ddp import checkpoint_writer

OPT = optax.sgd(0.5, momentum=0.9)  # linear in the gradient: a wrong average shows
BATCHES = make_batches(5, 8)


@pytest.fixture(scope="module")
def trajectory():
    """The one-device reference's parameters after each step (index 0: initial)."""
    ref = Reference(Net(0), OPT)
    out = [jax.tree.map(np.asarray, ref.params)]
    for batch in BATCHES:
        ref.step(batch)
        out.append(jax.tree.map(np.asarray, ref.params))
    return out


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_async_saves_hold_their_step_while_training_goes_on(world, tmp_path, trajectory, kind):
    if kind == "fsdp":
        model = jfsdp.FullyShardedDataParallel(Net(0), OPT, group=group(4), units=Block)
    else:
        model = jddp.DistributedDataParallel(Net(0), OPT, group=group(4))
    save, restore = (jfsdp.save_checkpoint, jfsdp.restore_checkpoint) if kind == "fsdp" else (
        jddp.save_checkpoint, jddp.restore_checkpoint)
    for i, batch in enumerate(BATCHES, start=1):
        model.train_step(loss_fn, batch)
        if i in (2, 3):  # two saves in a row: the second waits for the first
            assert save(tmp_path, model, data_state={"step": i}, async_save=True) == i
            assert checkpoint_writer._pending is not None  # in flight while training goes on
    jddp.wait_for_checkpoints()
    assert checkpoint_writer._pending is None
    assert jddp.latest_step(tmp_path) == 3
    for step in (2, 3):  # each holds its own step's state, resharded onto 2 ranks
        if kind == "fsdp":
            back = jfsdp.FullyShardedDataParallel(Net(5), OPT, group=group(2), units=Block)
        else:
            back = jddp.DistributedDataParallel(Net(5), OPT, group=group(2))
        assert restore(tmp_path, back, step=step) == (step, {"step": step})
        params = back.full_params() if kind == "fsdp" else back.params
        assert_trees_close(params, trajectory[step])
        for batch in BATCHES[step:]:  # and trains on to the uninterrupted run's parameters
            back.train_step(loss_fn, batch)
        # float32 rounding of the 2-rank gradient mean against one device's, amplified by
        # steps of 0.5 with momentum: up to 1.7e-5 relative (jax 0.12); a lost momentum or
        # a wrong average moves the parameters by orders of magnitude more
        assert_trees_close(back.full_params() if kind == "fsdp" else back.params,
                           trajectory[-1], rtol=5e-5, atol=5e-5)


def test_async_save_rejects_a_non_bool(world, tmp_path):
    model = jddp.DistributedDataParallel(Net(0), OPT, group=group(2))
    with pytest.raises(TypeError, match="async_save must be a bool; got 'yes'"):
        jddp.save_checkpoint(tmp_path, model, async_save="yes")
    with pytest.raises(TypeError, match="async_save must be a bool"):
        jfsdp.save_checkpoint(tmp_path, model, async_save=1)


_KILLED_WHILE_WRITING = textwrap.dedent("""
    import os, signal, sys
    import jax, numpy as np, optax
    sys.path.insert(0, {tests!r})
    from _fsdp_models import Block, Net, group, loss_fn, make_batches
    import jaxpg
    from jaxpg import fsdp as jfsdp
    from orbax.checkpoint._src.path import async_path

    jaxpg.init_process_group()
    model = jfsdp.FullyShardedDataParallel(Net(0), optax.sgd(0.5, momentum=0.9), group=group(4),
                                           units=Block)
    real_rename = async_path.rename

    async def dying_rename(src, dst):  # orbax's commit of step 2, in its background thread
        if os.path.basename(str(dst)) == "2":
            print("DYING", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return await real_rename(src, dst)

    async_path.rename = dying_rename
    for i, batch in enumerate(make_batches(5, 8), start=1):
        model.train_step(loss_fn, batch)
        if i in (1, 2):
            jfsdp.save_checkpoint({ckpt!r}, model, data_state={{"step": i}}, async_save=True)
            print("SAVED", i, flush=True)
    jfsdp.wait_for_checkpoints()
    print("NOT KILLED", flush=True)
""")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_killed_during_an_async_write_leaves_the_previous_checkpoint(world, tmp_path,
                                                                     trajectory):
    script = _KILLED_WHILE_WRITING.format(tests=os.path.dirname(__file__),
                                          ckpt=str(tmp_path / "ckpt"))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=110, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == -9, result.stdout + result.stderr[-3000:]
    assert "SAVED 2" in result.stdout and "DYING" in result.stdout  # the save had returned
    assert "NOT KILLED" not in result.stdout
    leftovers = os.listdir(tmp_path / "ckpt")
    assert "1" in leftovers and "2" not in leftovers
    assert jfsdp.latest_step(tmp_path / "ckpt") == 1
    back = jfsdp.FullyShardedDataParallel(Net(5), OPT, group=group(2), units=Block)
    assert jfsdp.restore_checkpoint(tmp_path / "ckpt", back) == (1, {"step": 1})
    assert_trees_close(back.full_params(), trajectory[1])
