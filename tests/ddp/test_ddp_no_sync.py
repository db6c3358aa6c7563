"""no_sync: k micro-steps reduce once and equal training on the union of micro-batches."""

import jax
import numpy as np
import optax
import pytest
from _ddp_models import MLP, Reference, assert_trees_close, group, loss_fn, make_batches

from jaxpg.ddp import DistributedDataParallel


@pytest.mark.parametrize("n", [2, 4])
def test_no_sync_accumulates_like_torch(world, n):
    k, opt = 3, optax.sgd(0.05, momentum=0.9)
    ddp = DistributedDataParallel(MLP(0), opt, group=group(n), bucket_cap_mb=0.0005,
                                  first_bucket_mb=0.0002)
    ref = Reference(MLP(0), opt)
    micro = make_batches(2 * k, 4 * n)
    for outer in range(2):
        chunk = micro[outer * k:(outer + 1) * k]
        with ddp.no_sync():
            for batch in chunk[:-1]:
                ddp.train_step(loss_fn, batch)
        assert ddp.step == outer
        ddp.train_step(loss_fn, chunk[-1])
        # torch sums the micro-steps' gradients: the reference adds the union's mean grads
        grads = [ref.grads(ref.params, ref.rest, b)[1] for b in chunk]
        ref.apply(jax.tree.map(lambda *g: sum(g), *grads))
    assert ddp.step == 2
    assert_trees_close(ddp.params, ref.params)


def test_no_sync_leaves_parameters_and_blocks_state_dict(world):
    ddp = DistributedDataParallel(MLP(0), optax.sgd(0.1), group=group(2))
    before = jax.tree.map(np.asarray, ddp.params)
    with ddp.no_sync():
        ddp.train_step(loss_fn, make_batches(1, 8)[0])
        with pytest.raises(RuntimeError, match="no_sync"):
            ddp.state_dict()
    assert_trees_close(ddp.params, before, rtol=0, atol=0)
