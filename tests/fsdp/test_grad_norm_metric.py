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
                                           zero_stage=3 if wrapper == "fsdp3" else 1)
    metrics = [wrapped.train_step(loss_fn, b) for b in batches]
    assert {"loss", "grad_norm"} <= set(metrics[0])
    got = [float(m["grad_norm"]) for m in metrics]
    # a norm over one rank's shard only, or summed over every replica, is far off
    np.testing.assert_allclose(got, one_device_norms(batches), rtol=1e-5, atol=1e-6)


def test_grad_norm_of_a_tensor_parallel_model_under_ddp(world):
    """DDP over dp_replicate of a Llama split over tp: each tp rank holds a slice of the
    split kernels, whose squares are summed over tp, and whole copies of the norms, which
    are not."""
    import jaxpg
    from jaxpg import models

    config = models.config_for("llama3-tiny")
    window = np.random.default_rng(2).integers(0, 64, (8, 17)).astype(np.int32)
    batch = {"tokens": window[:, :-1], "targets": window[:, 1:]}

    def lm_loss(model, b):
        logits = model(b["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

    graphdef, params = nnx.split(models.CausalLM(config, rngs=nnx.Rngs(4)))
    want = float(optax.tree.norm(jax.grad(lambda p: lm_loss(nnx.merge(graphdef, p), batch))(
        params)))
    dims = jaxpg.ParallelDims(dp_replicate=4, tp=2)
    model = models.CausalLM(config, rngs=nnx.Rngs(4))
    models.parallelize(model, dims, fsdp=False)
    ddp = DistributedDataParallel(model, optax.sgd(LR), group=dims.get_group("dp_replicate"))
    got = float(ddp.train_step(lm_loss, batch)["grad_norm"])
    np.testing.assert_allclose(got, want, rtol=1e-5)
