"""Stage stacks in rank order: the same loss and gradients as model order, no resharding."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpg
from jaxpg.pipeline import (
    StagedParams,
    get_schedule,
    make_train_step,
    pipeline_value_and_grad,
)
from jaxpg.pipeline.param_placement import place_pipeline_params
from jaxpg.pipeline.stage.order import to_model_order, to_rank_order

# meshes of 2 to 8 devices: not on one GPU (tools/gpu_check.sh)
pytestmark = pytest.mark.cpu_only

D = 8


def block(w, x):
    return jnp.tanh(x @ w["w"] + w["b"])


def loss(_, y, t):
    return jnp.mean((y - t) ** 2)


def make_params(num_stages, seed=0):
    k = jax.random.split(jax.random.key(seed), 2)
    return {"w": jax.random.normal(k[0], (num_stages, D, D)) * 0.5,
            "b": jax.random.normal(k[1], (num_stages, D)) * 0.1}


def batch(size=16, seed=1):
    kx, kt = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (size, D)), jax.random.normal(kt, (size, D))


@pytest.mark.parametrize("name, want", [
    ("interleaved_1f1b", [0, 2, 1, 3]),  # rank 0 runs stages 0 and 2, rank 1 stages 1 and 3
    ("zb_v", [0, 3, 1, 2]),  # V: rank 0 runs stages 0 and 3, rank 1 stages 1 and 2
    ("1f1b", None),  # one chunk per rank: rank order is model order
])
def test_rank_order_puts_each_ranks_stages_together(name, want):
    v = 1 if want is None else 2
    tt = get_schedule(name, 2, 4, v)
    stages = {"id": jnp.arange(2 * v, dtype=jnp.float32)}
    ranked = to_rank_order(stages, tt)
    np.testing.assert_array_equal(ranked["id"], want if want else [0, 1])
    np.testing.assert_array_equal(to_model_order(ranked, tt)["id"], stages["id"])


@pytest.mark.parametrize("name", ["interleaved_1f1b", "zb_v"])
def test_rank_order_gives_the_model_orders_loss_and_gradients(name):
    mesh = jaxpg.ParallelDims(dp_replicate=4, pp=2)
    tt = get_schedule(name, 2, 4, 2)
    params = make_params(4)
    x, t = batch()
    kwargs = dict(mesh=mesh, schedule=tt)
    want_loss, want = pipeline_value_and_grad(block, loss, params, x, t, **kwargs)
    ranked = place_pipeline_params(to_rank_order(params, tt), mesh)
    got_loss, got = pipeline_value_and_grad(block, loss, ranked, x, t, stage_order="rank",
                                            **kwargs)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 to_model_order(got, tt), want)


def _collectives_outside_the_loop(params, tt, stage_order):
    mesh = jaxpg.ParallelDims(dp_replicate=4, pp=2)
    x, t = batch()
    fn = jax.jit(lambda p, x, t: pipeline_value_and_grad(
        block, loss, p, x, t, mesh=mesh, schedule=tt, stage_order=stage_order))
    hlo = fn.lower(place_pipeline_params(params, mesh), x, t).compile().as_text()
    return [op for op in ("all-gather(", "all-to-all(") if op in hlo]


def test_rank_order_moves_no_parameter_between_devices():
    tt = get_schedule("interleaved_1f1b", 2, 4, 2)
    params = make_params(4)
    assert _collectives_outside_the_loop(params, tt, "model")  # model order reshards
    assert not _collectives_outside_the_loop(to_rank_order(params, tt), tt, "rank")


def test_train_step_in_rank_order_matches_model_order():
    mesh = jaxpg.ParallelDims(dp_replicate=4, pp=2)
    tt = get_schedule("zb_v", 2, 4, 2)
    params = StagedParams(make_params(4))
    x, t = batch()
    opt = optax.adam(1e-2)
    results = {}
    for order, start in (("model", params), ("rank", to_rank_order(params, tt))):
        step = make_train_step(block, loss, opt, mesh=mesh, schedule=tt, stage_order=order)
        p = place_pipeline_params(start, mesh)
        state = opt.init(p)
        for _ in range(2):
            p, state, value = step(p, state, x, t)
        results[order] = (to_model_order(p, tt) if order == "rank" else p, float(value))
    assert results["rank"][1] == pytest.approx(results["model"][1], rel=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 results["rank"][0], results["model"][0])


def test_bad_stage_order_and_stack_size_are_named():
    mesh = jaxpg.ParallelDims(dp_replicate=4, pp=2)
    x, t = batch()
    with pytest.raises(ValueError, match="stage_order='ranks'"):
        pipeline_value_and_grad(block, loss, make_params(2), x, t, mesh=mesh,
                                schedule="1f1b", num_microbatches=4, stage_order="ranks")
    with pytest.raises(ValueError, match="p \\* v = 2 \\* 2 = 4 stages"):
        to_rank_order(make_params(2), get_schedule("zb_v", 2, 4, 2))
