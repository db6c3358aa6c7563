"""SyncBatchNorm through Flax's axis_name: statistics of the whole global batch."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _ddp_models import MLP, Reference, assert_trees_close, group, loss_fn, make_batches

from jaxpg.ddp import DistributedDataParallel, convert_sync_batchnorm


@pytest.mark.parametrize("n", [2, 4])
def test_sync_batchnorm_statistics_equal_whole_batch(world, n):
    pg = group(n)
    model = convert_sync_batchnorm(MLP(0, batchnorm=True), pg)
    assert model.bn.axis_name == pg.axis_name
    opt = optax.sgd(0.1)
    ddp = DistributedDataParallel(model, opt, group=pg)
    ref = Reference(MLP(0, batchnorm=True), opt)
    for batch in make_batches(2, 4 * n):
        ddp.train_step(loss_fn, batch)
        ref.step(batch)
    assert_trees_close(ddp.rest, ref.rest)  # running mean and variance
    assert_trees_close(ddp.params, ref.params)
    snapshot = ddp.module
    snapshot.eval()  # running averages: no axis needed outside the step
    assert snapshot(jnp.zeros((3, 6))).shape == (3, 4)


def test_unsynchronised_batchnorm_keeps_rank0_statistics(world):
    # torch's broadcast_buffers: without SyncBatchNorm every rank starts from rank 0's buffers.
    ddp = DistributedDataParallel(MLP(0, batchnorm=True), optax.sgd(0.1), group=group(2))
    batch = make_batches(1, 8)[0]
    ddp.train_step(loss_fn, batch)
    ref = Reference(MLP(0, batchnorm=True), optax.sgd(0.1))
    ref.step({k: v[:4] for k, v in batch.items()})
    np.testing.assert_allclose(ddp.rest["bn"]["mean"][...], ref.rest["bn"]["mean"][...],
                               rtol=1e-5, atol=1e-6)


def test_convert_rejects_non_nnx():
    with pytest.raises(TypeError, match="nnx.Module"):
        convert_sync_batchnorm({"w": 1})


def test_sync_batchnorm_axis_is_the_groups_axis_and_averages_over_it(world):
    import jax
    from flax import linen as nn

    import jaxpg
    from jaxpg.ddp import sync_batchnorm_axis

    pg = group(4)
    assert sync_batchnorm_axis(pg) == pg.axis_name
    assert sync_batchnorm_axis() == jaxpg.GroupMember.WORLD.axis_name
    assert sync_batchnorm_axis(pg) != sync_batchnorm_axis()
    # A Linen BatchNorm over that axis normalises with the statistics of all 4 ranks' rows.
    bn = nn.BatchNorm(use_running_average=False, axis_name=sync_batchnorm_axis(pg),
                      use_bias=False, use_scale=False, epsilon=1e-5)
    x = np.random.default_rng(0).normal(size=(4, 3, 2)).astype(np.float32)  # 4 ranks x 3 rows
    variables = bn.init(jax.random.key(0), x[0])

    def per_rank(rows):
        return bn.apply(variables, rows, mutable=["batch_stats"])[0]

    got = np.asarray(jax.jit(jaxpg.spmd(per_rank, group=pg))(x))
    whole = x.reshape(12, 2)
    want = (whole - whole.mean(0)) / np.sqrt(whole.var(0) + 1e-5)
    np.testing.assert_allclose(got.reshape(12, 2), want, rtol=1e-4, atol=1e-5)
