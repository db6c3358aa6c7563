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
    assert "shard_optimizer_state=True" in repr(zero)


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
