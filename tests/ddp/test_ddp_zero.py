"""DistributedDataParallel(shard_optimizer_state=True): ZeRO-1 keeps DDP's reducer and hooks.

The independent reference is one-device optax training on the whole batch (``Reference``);
with a compression hook, whose rounding a one-device run does not share, the reference is
DDP with the same hook.
"""

import jax
import numpy as np
import optax
import pytest
from _ddp_models import MLP, Reference, assert_trees_close, group, loss_fn, make_batches

from jaxpg.ddp import DistributedDataParallel


@pytest.mark.parametrize("hook", [None, "bf16_compress"])
def test_sharded_optimizer_state_gives_the_references_parameters(world, hook):
    # SGD with momentum: its state is sharded, and its update shows a wrong gradient scale
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.5, momentum=0.9))
    kwargs = {"group": group(4), "comm_hook": hook, "bucket_cap_mb": 0.0005,
              "first_bucket_mb": 0.0002}
    zero = DistributedDataParallel(MLP(0), opt, shard_optimizer_state=True, **kwargs)
    # without a hook: plain optax on one device; with bf16 compression: DDP with the same hook
    ref = Reference(MLP(0), opt) if hook is None else DistributedDataParallel(MLP(0), opt,
                                                                              **kwargs)
    assert len(zero.bucket_plan) > 1  # the same bucketed reducer
    for batch in make_batches(3, 16):
        zero.train_step(loss_fn, batch)
        if hook is None:
            ref.step(batch)
        else:
            ref.train_step(loss_fn, batch)
    assert_trees_close(zero.params, ref.params)
    # each rank holds a quarter of the moments (6 rows padded to 8, 2 per rank)
    mu = zero.opt_state[1][0].trace["l1"]["kernel"]
    assert mu.shape == (8, 16) and mu.addressable_shards[0].data.shape == (2, 16)
    np.testing.assert_array_equal(np.asarray(mu)[6:], 0)  # the padding stays zero
    assert_trees_close(jax.tree.map(lambda a: np.asarray(a)[:6], mu),
                       ref.opt_state[1][0].trace["l1"]["kernel"])
    assert zero.params["l1"]["kernel"].sharding.is_fully_replicated
    assert "zero_stage=1" in repr(zero)


def test_sharded_optimizer_state_under_join(world):
    # a step with one rank out of data: the update is still applied to every shard
    opt = optax.sgd(0.1, momentum=0.9)
    zero = DistributedDataParallel(MLP(0), opt, group=group(2), shard_optimizer_state=True)
    ref = Reference(MLP(0), opt)  # rank 0's half alone, its gradient divided by the 2 ranks
    with zero.join():
        for batch in make_batches(2, 8):
            zero.train_step(loss_fn, batch, active=[True, False])
            half = jax.tree.map(lambda a: a[:4], batch)
            ref.apply(jax.tree.map(lambda g: g / 2, ref.grads(ref.params, ref.rest, half)[1]))
    assert_trees_close(zero.params, ref.params)
    with pytest.raises(TypeError, match="shard_optimizer_state='yes' must be a bool"):
        DistributedDataParallel(MLP(0), opt, shard_optimizer_state="yes")


def test_zero_stage_is_the_one_keyword_and_the_aliases_name_the_same_stage(world):
    from jaxpg.fsdp import FullyShardedDataParallel

    opt = optax.sgd(0.1)
    one = DistributedDataParallel(MLP(0), opt, group=group(2), zero_stage=1)
    alias = DistributedDataParallel(MLP(0), opt, group=group(2), shard_optimizer_state=True)
    plain = DistributedDataParallel(MLP(0), opt, group=group(2), zero_stage=0)
    assert one._zero is not None and alias._zero is not None and plain._zero is None
    assert "zero_stage=1" in repr(one) and "zero_stage=0" in repr(plain)
    with pytest.raises(ValueError, match=r"zero_stage=2 is not a ZeRO stage it runs.*"
                                         r"FullyShardedDataParallel\(\.\.\., zero_stage=2"):
        DistributedDataParallel(MLP(0), opt, zero_stage=2)
    with pytest.raises(ValueError, match="pass zero_stage= only, not zero_stage= and "
                                         "shard_optimizer_state="):
        DistributedDataParallel(MLP(0), opt, zero_stage=1, shard_optimizer_state=True)
    stages = [FullyShardedDataParallel(MLP(0), opt, group=group(2), **kw).stage
              for kw in ({"zero_stage": 2}, {"stage": 2}, {"level": "os_g"}, {})]
    assert stages == [2, 2, 2, 3]
    from jaxpg.ddp import ZeroRedundancyOptimizer

    params = {"w": np.zeros(4, np.float32)}
    with pytest.raises(ValueError, match=r"zero_stage=3 .*ZeRO-3 is FullyShardedDataParallel"):
        ZeroRedundancyOptimizer(opt, params, zero_stage=3)
    with pytest.raises(ValueError, match="not zero_stage= and reduce_gradients="):
        ZeroRedundancyOptimizer(opt, params, zero_stage=2, reduce_gradients=True)
