"""``grad_norm`` in the metrics of DDP's and FSDP's ``train_step``: the global L2 norm of
the averaged gradients equals ``optax.tree.norm`` of one-device gradients on the whole
batch, for replicated parameters (DDP), sharded ones with padding (FSDP stage 3) and
all-reduced ones (FSDP stage 1), over two SGD steps."""

import jax
import numpy as np
import optax
import pytest
from _fsdp_models import Block, Net, group, loss_fn, make_batches
from flax import nnx

from jaxpg.ddp import DistributedDataParallel
from jaxpg.fsdp import FullyShardedDataParallel

N, LR = 8, 0.5


def one_device_norms(batches):
    graphdef, params = nnx.split(Net(0), nnx.Param)
    grad = jax.jit(jax.grad(lambda p, b: loss_fn(nnx.merge(graphdef, p), b)))
    norms = []
    for batch in batches:
        g = grad(params, batch)
        norms.append(float(optax.tree.norm(g)))
        params = jax.tree.map(lambda p, d: p - LR * d, params, g)
    return norms


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp3", "fsdp1"])
def test_grad_norm_is_the_whole_gradients_norm(world, wrapper):
    batches = make_batches(2, 4 * N)
    if wrapper == "ddp":
        wrapped = DistributedDataParallel(Net(0), optax.sgd(LR), group=group(N))
    else:
        wrapped = FullyShardedDataParallel(Net(0), optax.sgd(LR), group=group(N), units=Block,
                                           stage=3 if wrapper == "fsdp3" else 1)
    metrics = [wrapped.train_step(loss_fn, b) for b in batches]
    assert {"loss", "grad_norm"} <= set(metrics[0])
    got = [float(m["grad_norm"]) for m in metrics]
    # a norm over one rank's shard only, or summed over every replica, is far off
    np.testing.assert_allclose(got, one_device_norms(batches), rtol=1e-5, atol=1e-6)
