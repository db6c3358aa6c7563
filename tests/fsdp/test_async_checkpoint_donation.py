"""An asynchronous save under buffer donation, with orbax's background write held back until
the next steps have run: the checkpoint holds the state of its step, and those steps still
donate the state's buffers (updating them in place) while the write is pending.

The save stages the state in its own copy. Without it, orbax's host copy on CPU is a view of
the state's buffers: PJRT then refuses to donate them (the step silently copies the whole
state instead, and the arrays it was given stay alive), so the donation is what the test
can see go wrong."""

import asyncio
import threading
import time

import jax
import numpy as np
import optax
import pytest
from _fsdp_models import Block, Net, group, loss_fn, make_batches

from jaxpg import ddp as jddp
from jaxpg import fsdp as jfsdp

OPT = optax.sgd(0.5)
BATCHES = make_batches(3, 8, seed=4)


@pytest.fixture
def held_writes(monkeypatch):
    """Holds orbax's background array writes until the event is set (at most 60 s)."""
    from orbax.checkpoint._src.serialization import serialization

    release, started = threading.Event(), []
    real = serialization.async_serialize_from_host

    async def late(*args, **kwargs):
        started.append(time.monotonic())
        deadline = time.monotonic() + 60
        while not release.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return await real(*args, **kwargs)

    monkeypatch.setattr(serialization, "async_serialize_from_host", late)
    yield release, started
    release.set()
    jddp.wait_for_checkpoints()


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_late_async_write_holds_the_saved_step_under_donation(world, tmp_path, held_writes,
                                                                kind):
    release, started = held_writes
    if kind == "fsdp":
        make = lambda seed, n: jfsdp.FullyShardedDataParallel(Net(seed), OPT, group=group(n),
                                                              units=Block)
        save, restore = jfsdp.save_checkpoint, jfsdp.restore_checkpoint
        whole = lambda m: m.full_params()
    else:
        make = lambda seed, n: jddp.DistributedDataParallel(Net(seed), OPT, group=group(n))
        save, restore = jddp.save_checkpoint, jddp.restore_checkpoint
        whole = lambda m: m.params
    model = make(0, 4)
    assert model.donate  # the next step donates the state's buffers
    model.train_step(loss_fn, BATCHES[0])
    at_save = jax.tree.map(lambda x: np.array(x, copy=True), whole(model))
    assert save(tmp_path, model, async_save=True) == 1
    given = jax.tree.leaves(model.params)
    for batch in BATCHES[1:]:  # the write has not run yet while these steps donate
        jax.block_until_ready(model.train_step(loss_fn, batch))
    donated = [x.is_deleted() for x in given]
    assert all(donated), f"{donated.count(False)} of {len(given)} parameter buffers were " \
        "not donated while the save was pending"
    after = jax.tree.map(np.asarray, whole(model))
    assert not np.allclose(after["head"]["kernel"], at_save["head"]["kernel"])
    release.set()
    jddp.wait_for_checkpoints()
    assert started  # the write did go through the held path
    back = make(5, 2)
    assert restore(tmp_path, back)[0] == 1
    for got, want in zip(jax.tree.leaves(whole(back)), jax.tree.leaves(at_save), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
