"""make_train_step, parameter placement on the pipeline mesh and Flax NNX stages."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

import jaxpg
from jaxpg.pipeline.api import StagedParams, pipeline_value_and_grad
from jaxpg.pipeline.stage.nnx_stages import module_fn, split_module, stack_modules
from jaxpg.pipeline.train_step import init_train_state, make_train_step

# meshes of 2 to 8 devices: not on one GPU (tools/gpu_check.sh)
pytestmark = pytest.mark.cpu_only


class Block(nnx.Module):
    def __init__(self, d, rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.lin = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.lin(self.norm(x)))


def nnx_model(p):
    graphdef, stages = stack_modules(lambda rngs: Block(8, rngs), p)
    embed_g, embed_s = split_module(nnx.Embed(11, 8, rngs=nnx.Rngs(9)))
    head_g, head_s = split_module(nnx.Linear(8, 11, rngs=nnx.Rngs(10)))
    block, embed, head = module_fn(graphdef), module_fn(embed_g), module_fn(head_g)

    def loss_fn(head_state, y, t):
        logits = head(head_state, y)
        return optax.softmax_cross_entropy_with_integer_labels(logits, t).mean()

    return block, embed, loss_fn, StagedParams(stages, embed_s, head_s)


def reference_loss(block, embed, loss_fn, params, x, t, num_stages):
    h = embed(params.first, x)
    for s in range(num_stages):
        h = block(jax.tree.map(lambda a, s=s: a[s], params.stages), h)
    return loss_fn(params.last, h, t)


@pytest.mark.parametrize(
    "name,p,v,remat", [("zb_h1", 4, 1, False), ("zb_h1", 4, 1, True), ("zb_v", 2, 2, False)]
)
def test_nnx_blocks_match_reference(name, p, v, remat):
    block, embed, loss_fn, params = nnx_model(p * v)
    x = jax.random.randint(jax.random.key(0), (8, 5), 0, 11)
    t = jax.random.randint(jax.random.key(1), (8, 5), 0, 11)
    loss, grads = pipeline_value_and_grad(
        block, loss_fn, params, x, t,
        mesh=Mesh(np.array(jax.devices()[: 2 * p]).reshape(2, p), ("dp", "pp")), schedule=name,
        num_microbatches=4, first_fn=embed, remat=remat,
    )  # fmt: skip
    want_loss, want_grads = jax.value_and_grad(
        lambda q: reference_loss(block, embed, loss_fn, q, x, t, p * v)
    )(params)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), grads, want_grads
    )


@pytest.mark.parametrize("remat", [False, True])
def test_train_step_equals_optax_on_reference_grads(remat):
    block, embed, loss_fn, params = nnx_model(2)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "pp"))
    x = jax.random.randint(jax.random.key(0), (8, 5), 0, 11)
    t = jax.random.randint(jax.random.key(1), (8, 5), 0, 11)
    optimizer = optax.sgd(0.5, momentum=0.9)  # dp = 2: a wrong gradient average shows
    ref_params, ref_state = params, optimizer.init(params)
    params, opt_state = init_train_state(params, optimizer, mesh)
    step = make_train_step(
        block, loss_fn, optimizer, mesh=mesh, schedule="1f1b", num_microbatches=2,
        first_fn=embed, remat=remat,
    )  # fmt: skip
    losses = []
    for _ in range(3):
        params, opt_state, loss = step(params, opt_state, x, t)
        losses.append(float(loss))
        ref_loss, g = jax.value_and_grad(
            lambda q: reference_loss(block, embed, loss_fn, q, x, t, 2)
        )(ref_params)
        updates, ref_state = optimizer.update(g, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert losses[-1] < losses[0]
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), params, ref_params
    )


def test_bad_optimizer_and_module():
    with pytest.raises(TypeError, match="remat=None must be True or False"):
        make_train_step(
            lambda w, x: x, lambda h, y, t: 0.0, optax.sgd(1.0), mesh=jaxpg.ParallelDims(pp=2),
            remat=None
        )
    with pytest.raises(TypeError, match="optax.GradientTransformation"):
        make_train_step(lambda w, x: x, lambda h, y, t: 0.0, "adam",
                        mesh=jaxpg.ParallelDims(pp=2))
    with pytest.raises(TypeError, match="nnx.Module"):
        split_module(object())
    with pytest.raises(ValueError, match="positive int"):
        stack_modules(lambda rngs: Block(8, rngs), 0)
