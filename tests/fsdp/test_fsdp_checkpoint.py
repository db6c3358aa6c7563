"""Sharded checkpoints: saved by 4 ranks, loaded by 2 (and other stages), trained on; full
checkpoints to and from DDP; consolidation; mismatches named; a damaged newest step skipped."""

import logging

import jax
import numpy as np
import optax
import pytest
from _damage import cut_array_files
from _fsdp_models import Block, Net, Reference, assert_trees_close, group, loss_fn, make_batches
from flax import nnx

import jaxpg
from jaxpg.ddp import DistributedDataParallel
from jaxpg.ddp import restore_checkpoint as ddp_restore
from jaxpg.ddp import save_checkpoint as ddp_save
from jaxpg.fsdp import FullyShardedDataParallel
from jaxpg.fsdp.checkpoint import consolidate_checkpoint, restore_checkpoint, save_checkpoint

OPT = optax.sgd(0.1, momentum=0.9)  # linear in the gradient: a wrong average shows
BATCHES = make_batches(5, 8)


@pytest.fixture(scope="module")
def uninterrupted():
    ref = Reference(Net(0), OPT)
    for batch in BATCHES:
        ref.step(batch)
    return jax.tree.map(np.asarray, ref.params)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run of 3 steps on 4 ranks saved sharded (``dir/sharded``) and full (``dir/full``);
    returns the directory and the parameters at the save."""
    directory = tmp_path_factory.mktemp("fsdp_ckpt")
    jaxpg.init_process_group()
    fsdp = FullyShardedDataParallel(Net(0), OPT, group=group(4), units=Block)
    for batch in BATCHES[:3]:
        fsdp.train_step(loss_fn, batch)
    for kind in ("sharded", "full"):
        save_checkpoint(directory / kind, fsdp, data_state={"epoch": 0, "batch": 3},
                        full=kind == "full")
    params = jax.tree.map(np.asarray, fsdp.full_params())
    jaxpg.destroy_process_group()
    return directory, params


def test_save_with_4_ranks_load_with_2_and_train_on(saved, world, uninterrupted):
    # padded to 8 rows for 4 ranks, to 8 again for 2 (7 -> 8) but (1, 12) -> 2 rows, etc.
    resumed = FullyShardedDataParallel(Net(5), OPT, group=group(2), units=Block)
    step, data_state = restore_checkpoint(saved[0] / "sharded", resumed)
    assert (step, data_state) == (3, {"epoch": 0, "batch": 3}) and resumed.step == 3
    assert resumed.params["pos"].shape == (2, 12)
    for batch in BATCHES[3:]:
        resumed.train_step(loss_fn, batch)
    assert_trees_close(resumed.full_params(), uninterrupted)


@pytest.mark.parametrize("stage", [1, 2])
def test_load_onto_another_stage(saved, world, uninterrupted, stage):
    resumed = FullyShardedDataParallel(Net(5), OPT, group=group(8), zero_stage=stage)
    restore_checkpoint(saved[0] / "sharded", resumed)
    for batch in BATCHES[3:]:
        resumed.train_step(loss_fn, batch)
    assert_trees_close(resumed.full_params(), uninterrupted)


def test_full_checkpoints_to_and_from_ddp(saved, world, tmp_path, uninterrupted):
    ddp = DistributedDataParallel(Net(5), OPT, group=group(2))
    assert ddp_restore(saved[0] / "full", ddp) == (3, {"epoch": 0, "batch": 3})
    ddp_save(tmp_path / "ddp", ddp)  # and DDP's own checkpoint back into FSDP
    fsdp = FullyShardedDataParallel(Net(5), OPT, group=group(4), units=Block)
    assert restore_checkpoint(tmp_path / "ddp", fsdp)[0] == 3
    for batch in BATCHES[3:]:
        ddp.train_step(loss_fn, batch)
        fsdp.train_step(loss_fn, batch)
    assert_trees_close(ddp.params, uninterrupted)
    assert_trees_close(fsdp.full_params(), uninterrupted)


def test_consolidate_a_sharded_checkpoint(saved, world, tmp_path):
    assert consolidate_checkpoint(saved[0] / "sharded", tmp_path / "full") == 3
    ddp = DistributedDataParallel(Net(5), OPT, group=group(2))
    ddp_restore(tmp_path / "full", ddp)
    assert_trees_close(ddp.params, saved[1], rtol=0, atol=0)


def test_a_checkpoint_of_another_model_is_named(saved, world, tmp_path):

    class Wider(Net):
        def __init__(self):
            super().__init__(0)
            self.head = nnx.Linear(12, 6, rngs=nnx.Rngs(0))

    with pytest.raises(ValueError, match=r"\['head'\]\['bias'\].* has shape \(5,\) \(stored "
                                         r"padded as \(8,\)\), this model's is \(6,\)"):
        restore_checkpoint(saved[0] / "sharded",
                           FullyShardedDataParallel(Wider(), OPT, group=group(2)))
    other_opt = FullyShardedDataParallel(Net(0), optax.sgd(0.1), group=group(2))
    with pytest.raises(ValueError, match="first difference is array 0"):
        restore_checkpoint(saved[0] / "sharded", other_opt)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        restore_checkpoint(tmp_path / "nothing", other_opt)


def test_a_damaged_newest_checkpoint_falls_back_to_the_step_before(world, tmp_path, caplog):
    fsdp = FullyShardedDataParallel(Net(0), OPT, group=group(4), units=Block)
    at = {}
    for i, batch in enumerate(BATCHES[:3]):
        fsdp.train_step(loss_fn, batch)
        save_checkpoint(tmp_path, fsdp, data_state={"batch": i + 1})
        at[fsdp.step] = jax.tree.map(np.asarray, fsdp.full_params())
    resumed = FullyShardedDataParallel(Net(5), OPT, group=group(2), units=Block)
    with caplog.at_level(logging.WARNING, logger="absl"):  # orbax logs through absl
        assert restore_checkpoint(tmp_path, resumed) == (3, {"batch": 3})
    assert not [r for r in caplog.records if "could not be restored" in r.getMessage()]

    cut_array_files(tmp_path / "3")  # a node lost while writing step 3
    with pytest.warns(UserWarning) as seen:
        assert restore_checkpoint(tmp_path, resumed) == (2, {"batch": 2})
    texts = [str(w.message) for w in seen]
    assert len(texts) == 1 and "step=3: array file state/" in texts[0] \
        and "cut short" in texts[0] and "restoring step=2" in texts[0], texts
    assert_trees_close(resumed.full_params(), at[2], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"step=3 under .* is damaged: .*readable steps \[2, 1\]"):
        restore_checkpoint(tmp_path, resumed, step=3)
    with pytest.raises(FileNotFoundError, match=r"step=7 is not saved .* \[1, 2, 3\]"):
        restore_checkpoint(tmp_path, resumed, step=7)

    for step in (1, 2):
        cut_array_files(tmp_path / str(step))
    with pytest.raises(ValueError, match=r"no readable checkpoint under .*: the steps found, "
                                         r"\[1, 2, 3\], are all damaged \(step=3: .*; step=2: "
                                         r".*; step=1: "):
        restore_checkpoint(tmp_path, resumed)
