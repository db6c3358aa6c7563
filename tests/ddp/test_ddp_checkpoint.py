"""Checkpoints: a run stopped and resumed follows the uninterrupted run's trajectory; a
damaged newest step is skipped."""

import jax
import numpy as np
import optax
import pytest
from _damage import cut_array_files
from _ddp_models import MLP, assert_trees_close, group, loss_fn, make_batches

from jaxpg.ddp import (
    DistributedDataParallel,
    DistributedSampler,
    latest_step,
    restore_checkpoint,
    save_checkpoint,
)

N, PER_RANK, EPOCHS = 4, 4, 2
DATA = make_batches(1, 64, seed=3)[0]
STEPS_PER_EPOCH = 64 // (N * PER_RANK)


def _make_ddp(seed):
    return DistributedDataParallel(
        MLP(seed), optax.adam(1e-2), group=group(N), bucket_cap_mb=0.0005,
        first_bucket_mb=0.0002, comm_hook="powerSGD",
        comm_hook_config={"start_powerSGD_iter": 1, "matrix_approximation_rank": 2},
    )  # fmt: skip


def _global_batch(epoch, b):
    """Every rank's DistributedSampler share for step b, concatenated in rank order."""
    parts = []
    for r in range(N):
        sampler = DistributedSampler(64, num_replicas=N, rank=r, shuffle=True, seed=5)
        sampler.set_epoch(epoch)
        parts.append(sampler.indices()[b * PER_RANK:(b + 1) * PER_RANK])
    idx = np.concatenate(parts)
    return {k: v[idx] for k, v in DATA.items()}


def _train(ddp, start=(0, 0), stop_at=None, directory=None):
    epoch0, batch0 = start
    for epoch in range(epoch0, EPOCHS):
        for b in range(batch0 if epoch == epoch0 else 0, STEPS_PER_EPOCH):
            if ddp.step == stop_at:
                save_checkpoint(directory, ddp, data_state={"epoch": epoch, "batch": b})
                return
            ddp.train_step(loss_fn, _global_batch(epoch, b))


def test_resume_equals_uninterrupted_run(world, tmp_path):
    full = _make_ddp(0)
    _train(full)

    first = _make_ddp(0)
    _train(first, stop_at=5, directory=tmp_path)
    assert latest_step(tmp_path) == 5
    del first

    resumed = _make_ddp(seed=7)  # a different initialisation: everything comes from disk
    step, data_state = restore_checkpoint(tmp_path, resumed)
    assert (step, data_state) == (5, {"epoch": 1, "batch": 1})
    assert resumed.step == 5
    _train(resumed, start=(data_state["epoch"], data_state["batch"]))

    assert resumed.step == full.step == EPOCHS * STEPS_PER_EPOCH
    assert_trees_close(resumed.params, full.params, rtol=1e-6, atol=1e-6)
    assert_trees_close(resumed.opt_state, full.opt_state, rtol=1e-6, atol=1e-6)
    assert_trees_close(resumed.hook_state, full.hook_state, rtol=1e-6, atol=1e-6)
    assert resumed.hook_state.errors[0].shape[0] == N  # per-rank error buffers came back


def test_restore_errors(world, tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        restore_checkpoint(tmp_path / "missing", _make_ddp(0))
    ddp = _make_ddp(0)
    ddp.train_step(loss_fn, make_batches(1, N * PER_RANK)[0])
    save_checkpoint(tmp_path, ddp)
    other = DistributedDataParallel(MLP(0), optax.sgd(0.1), group=group(N))
    with pytest.raises(ValueError, match="Build the same model, optimizer"):
        restore_checkpoint(tmp_path, other)
    assert jax.tree.leaves(other.params)  # untouched


def test_a_damaged_newest_checkpoint_falls_back_to_the_step_before(world, tmp_path):
    ddp = _make_ddp(0)
    saved = {}
    for b in range(2):
        ddp.train_step(loss_fn, _global_batch(0, b))
        save_checkpoint(tmp_path, ddp, data_state={"epoch": 0, "batch": b + 1})
        saved[ddp.step] = jax.tree.map(np.asarray, ddp.params)
    cut_array_files(tmp_path / "2")
    resumed = _make_ddp(seed=7)
    with pytest.warns(UserWarning) as seen:
        assert restore_checkpoint(tmp_path, resumed) == (1, {"epoch": 0, "batch": 1})
    texts = [str(w.message) for w in seen]
    assert len(texts) == 1 and "step=2: array file" in texts[0] and "step=1" in texts[0], texts
    assert_trees_close(resumed.params, saved[1], rtol=0, atol=0)
    # the resumed run retrains step 2 and saves it again over the damaged one
    resumed.train_step(loss_fn, _global_batch(0, 1))
    save_checkpoint(tmp_path, resumed, data_state={"epoch": 0, "batch": 2})
    again = _make_ddp(seed=3)
    assert restore_checkpoint(tmp_path, again) == (2, {"epoch": 0, "batch": 2})
    assert_trees_close(again.params, saved[2], rtol=1e-6, atol=1e-6)
    for step in (1, 2):
        cut_array_files(tmp_path / str(step))
    with pytest.raises(ValueError, match=r"no readable checkpoint .* \[1, 2\], are all damaged"):
        restore_checkpoint(tmp_path, resumed)
