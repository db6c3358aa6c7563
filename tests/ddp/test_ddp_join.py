"""join(): uneven inputs against a reference where ranks out of data contribute zeros."""

import jax
import numpy as np
import optax
import pytest
from _ddp_models import MLP, Reference, assert_trees_close, group, loss_fn, make_batches

from jaxpg.ddp import DistributedDataParallel

LENGTHS = [3, 2, 3, 1]  # batches per rank
PER_RANK = 4


def _reference(divide_by_initial_world_size):
    n, opt = len(LENGTHS), optax.sgd(0.1, momentum=0.9)
    ref = Reference(MLP(0), opt)
    batches = make_batches(max(LENGTHS), PER_RANK * n)
    for step, batch in enumerate(batches):
        active = [r for r in range(n) if step < LENGTHS[r]]
        total = None
        for r in active:
            local = jax.tree.map(lambda x, r=r: x[r * PER_RANK:(r + 1) * PER_RANK], batch)
            g = ref.grads(ref.params, ref.rest, local)[1]
            total = g if total is None else jax.tree.map(np.add, total, g)
        denom = n if divide_by_initial_world_size else len(active)
        ref.apply(jax.tree.map(lambda x, d=denom: x / d, total))
    return ref, batches


@pytest.mark.parametrize("divide", [True, False])
def test_join_equals_zero_contribution_reference(world, divide):
    n = len(LENGTHS)
    ddp = DistributedDataParallel(MLP(0), optax.sgd(0.1, momentum=0.9), group=group(n),
                                  bucket_cap_mb=0.0005, first_bucket_mb=0.0002)
    ref, batches = _reference(divide)
    with ddp.join(divide_by_initial_world_size=divide) as join:
        for step, batch in enumerate(batches):
            active = [step < length for length in LENGTHS]
            ddp.train_step(loss_fn, batch, active=active)
            assert join.num_active == sum(active)
    assert_trees_close(ddp.params, ref.params)
    assert ddp._join is None


def test_step_with_no_active_rank_changes_nothing(world):
    ddp = DistributedDataParallel(MLP(0), optax.adam(0.1), group=group(2))
    batch = make_batches(1, 8)[0]
    with ddp.join():
        ddp.train_step(loss_fn, batch)
        before = jax.tree.map(np.asarray, (ddp.params, ddp.opt_state))
        metrics = ddp.train_step(loss_fn, batch, active=[False, False])
        assert int(metrics["num_active"]) == 0
        ddp.train_step(loss_fn, None)  # a shadow step: zeros shaped like the last batch
    assert_trees_close((ddp.params, ddp.opt_state), before, rtol=0, atol=0)


def test_throw_on_early_termination(world):
    ddp = DistributedDataParallel(MLP(0), optax.sgd(0.1), group=group(4))
    batches = make_batches(2, 16)
    with pytest.raises(RuntimeError, match="exhausted inputs"):
        with ddp.join(throw_on_early_termination=True):
            ddp.train_step(loss_fn, batches[0])
            before = jax.tree.map(np.asarray, ddp.params)
            ddp.train_step(loss_fn, batches[1], active=[True, True, False, True])
    assert_trees_close(ddp.params, before, rtol=0, atol=0)  # the failing step did not update
    assert ddp._join is None


def test_join_arguments(world):
    ddp = DistributedDataParallel(MLP(0), optax.sgd(0.1), group=group(2))
    with pytest.raises(TypeError, match="throw_on_early_termination"):
        ddp.join(throw_on_early_termination="yes")
    with pytest.raises(ValueError, match="one bool per rank"):
        with ddp.join():
            ddp.train_step(loss_fn, make_batches(1, 8)[0], active=[True])
    with ddp.join(enable=False):
        with pytest.raises(ValueError, match="inside `with ddp.join"):
            ddp.train_step(loss_fn, make_batches(1, 8)[0], active=[True, True])
