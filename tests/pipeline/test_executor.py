"""The pipeline executor against jax.value_and_grad of the un-pipelined model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jaxpg
from jaxpg.pipeline.api import StagedParams, pipeline_value_and_grad
from jaxpg.pipeline.lockstep.buffer_plan import plan_buffers
from jaxpg.pipeline.schedule.builders import get_schedule, one_f_one_b

# meshes of 2 to 8 devices: not on one GPU (tools/gpu_check.sh)
pytestmark = pytest.mark.cpu_only

D_IN, D, D_OUT = 3, 8, 2


def block(w, x):
    return jnp.tanh(x @ w["w"] + w["b"])


def embed(e, x):
    return x @ e


def head_loss(h, y, t):
    return jnp.mean((y @ h - t) ** 2)


def make_params(num_stages, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    stages = {
        "w": jax.random.normal(k[0], (num_stages, D, D)) * 0.5,
        "b": jax.random.normal(k[1], (num_stages, D)) * 0.1,
    }
    first = jax.random.normal(k[2], (D_IN, D))
    last = jax.random.normal(k[3], (D, D_OUT))
    return StagedParams(stages, first, last)


def make_batch(size, seed=1):
    kx, kt = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (size, D_IN)), jax.random.normal(kt, (size, D_OUT))


def reference(params, x, t, use_embed=True):
    def loss(params):
        h = embed(params.first, x) if use_embed else x
        for s in range(jax.tree.leaves(params.stages)[0].shape[0]):
            h = block(jax.tree.map(lambda a, s=s: a[s], params.stages), h)
        return head_loss(params.last, h, t)

    return jax.value_and_grad(loss)(params)


def assert_close(got, want):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), got, want)


def pp_mesh(p):
    return Mesh(np.array(jax.devices()[:p]), ("pp",))


def dp_pp_mesh(p, dp):
    """A ``("dp", "pp")`` jax Mesh over the first ``dp * p`` devices (rows are replicas)."""
    return Mesh(np.array(jax.devices()[: dp * p]).reshape(dp, p), ("dp", "pp"))


# Every schedule at p = 2 and 4, m = p, 2p and one m that is not a multiple of p, with
# the default remat=False (residuals kept); remat=True (stage-input recompute) on a
# thinner set that still runs every schedule at both p.
CASES = [
    (name, p, m, 1, False)
    for name in ("gpipe", "1f1b", "zb_h1")
    for p, ms in ((2, (2, 4, 3)), (4, (4, 8, 5)))
    for m in ms
] + [("interleaved_1f1b", p, m, 2, False) for p, m in ((2, 2), (2, 4), (4, 4), (4, 8))]
CASES += [("zb_v", p, m, 2, False) for p, m in ((2, 2), (2, 3), (2, 4), (4, 4), (4, 8), (4, 5))]
CASES += [
    (name, p, m, v, True)
    for name, v in (("gpipe", 1), ("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("zb_v", 2))
    for p, m in ((2, 4), (4, 8))
] + [("1f1b", 4, 5, 1, True), ("zb_h1", 2, 3, 1, True), ("zb_v", 4, 5, 2, True)]
CASES += [("dualpipe_v", 2, 4, 2, False), ("dualpipe_v", 4, 9, 2, False),
          ("dualpipe_v", 2, 5, 2, True), ("looped_bfs", 2, 3, 2, False),
          ("looped_bfs", 4, 4, 1, True)]  # fmt: skip


def assert_matches_reference(params, x, t, **kwargs):
    """The pipeline's loss and gradients (embed, blocks, head) equal the un-pipelined ones."""
    loss, grads = pipeline_value_and_grad(
        block, head_loss, params, x, t, first_fn=embed, **kwargs
    )
    want_loss, want_grads = reference(params, x, t)
    assert_close(loss, want_loss)
    assert_close(grads, want_grads)


@pytest.mark.parametrize("name,p,m,v,remat", CASES)
def test_schedule_matches_reference(name, p, m, v, remat):
    x, t = make_batch(2 * m)
    assert_matches_reference(
        make_params(p * v), x, t, mesh=pp_mesh(p), schedule=name, num_microbatches=m,
        remat=remat,
    )  # fmt: skip


@pytest.mark.parametrize("p,m,remat", [(4, 5, False), (2, 3, True)])
def test_one_f_one_b_with_split_backward_matches_reference(p, m, remat):
    x, t = make_batch(2 * m)
    assert_matches_reference(
        make_params(p), x, t, mesh=pp_mesh(p),
        schedule=one_f_one_b(p, m, split_backward=True), remat=remat,
    )  # fmt: skip


@pytest.mark.parametrize("remat", [False, True])
def test_plain_stacked_params_without_embedding_or_head(remat):
    params = make_params(4)
    x, _ = make_batch(8)
    x = x @ params.first  # inputs already have the block's width
    t = jnp.zeros((8, D))

    def mse(_, y, t):
        return jnp.mean((y - t) ** 2)

    loss, grads = pipeline_value_and_grad(
        block, mse, params.stages, x, t, mesh=pp_mesh(4), schedule="1f1b", num_microbatches=4,
        remat=remat,
    )  # fmt: skip
    ref_params = StagedParams(params.stages, None, jnp.eye(D))
    want_loss, want_grads = reference(ref_params, x, t, use_embed=False)
    assert_close(loss, want_loss)
    assert_close(grads, want_grads.stages)


@pytest.mark.parametrize(
    "name,v,remat", [("gpipe", 1, False), ("gpipe", 1, True), ("zb_v", 2, False)]
)
def test_pytree_activations(name, v, remat):
    def pair_block(w, xs):
        a, b = xs
        return (jnp.tanh(a @ w["w"] + b), b * 0.5 + w["b"])

    def pair_loss(_, ys, t):
        return jnp.mean((ys[0] + ys[1] - t) ** 2)

    params = make_params(2 * v).stages
    a, _ = make_batch(4)
    xs = (a @ jnp.ones((D_IN, D)), jnp.ones((4, D)))
    t = jnp.zeros((4, D))
    loss, grads = pipeline_value_and_grad(
        pair_block, pair_loss, params, xs, t, mesh=pp_mesh(2), schedule=name,
        num_microbatches=2, remat=remat,
    )  # fmt: skip

    def ref(params):
        h = xs
        for s in range(2 * v):
            h = pair_block(jax.tree.map(lambda q, s=s: q[s], params), h)
        return pair_loss(None, h, t)

    want_loss, want_grads = jax.value_and_grad(ref)(params)
    assert_close(loss, want_loss)
    assert_close(grads, want_grads)


@pytest.mark.parametrize(
    "p,v,name,remat",
    [
        (2, 1, "1f1b", False), (2, 1, "1f1b", True), (4, 1, "zb_h1", False),
        (4, 1, "zb_h1", True), (2, 2, "interleaved_1f1b", False), (2, 2, "zb_v", False),
    ],
)  # fmt: skip
def test_hybrid_dp_pp_matches_global_batch(p, v, name, remat):
    x, t = make_batch(4 * p)
    assert_matches_reference(
        make_params(p * v), x, t, mesh=dp_pp_mesh(p, 2), schedule=name,
        num_microbatches=p, remat=remat,
    )  # fmt: skip


@pytest.mark.parametrize("remat", [False, True])
def test_custom_grad_reducer_is_applied(remat):
    calls = []

    def reducer(g):
        calls.append(jax.tree.structure(g))
        return jax.tree.map(lambda a: jax.lax.psum(a, "dp") / 2, g)

    params = make_params(2)
    x, t = make_batch(8)
    loss, grads = pipeline_value_and_grad(
        block, head_loss, params, x, t, mesh=dp_pp_mesh(2, 2), schedule="1f1b",
        num_microbatches=2, first_fn=embed, grad_reducer=reducer, remat=remat,
    )  # fmt: skip
    assert calls, "the grad_reducer was never called"
    want_loss, want_grads = reference(params, x, t)
    assert_close(grads, want_grads)


def test_1f1b_buffers_do_not_grow_with_microbatches():
    slots = {m: plan_buffers(get_schedule("1f1b", 4, m)).num_act_slots for m in (4, 8, 16)}
    assert slots == {4: 4, 8: 4, 16: 4}
    gpipe = {m: plan_buffers(get_schedule("gpipe", 4, m)).num_act_slots for m in (4, 8)}
    assert gpipe == {4: 4, 8: 8}

    def temp_bytes(name, m, remat=False):
        x, t = make_batch(2 * m)
        f = jax.jit(
            functools.partial(
                pipeline_value_and_grad,
                block,
                head_loss,
                mesh=pp_mesh(4),
                schedule=name,
                num_microbatches=m,
                first_fn=embed,
                remat=remat,
            )  # fmt: skip
        )
        analysis = f.lower(make_params(4), x, t).compile().memory_analysis()
        return analysis.temp_size_in_bytes

    for remat in (False, True):
        assert temp_bytes("1f1b", 4, remat) == temp_bytes("1f1b", 16, remat)
    assert temp_bytes("gpipe", 16) > temp_bytes("gpipe", 4)
    # Keeping residuals costs memory (here tanh's output per slot), bounded by the slots.
    assert temp_bytes("1f1b", 8, False) > temp_bytes("1f1b", 8, True)


@pytest.mark.parametrize(
    "blocks,rows,p,schedule,m,match",
    [pytest.param(2, 6, 2, "1f1b", 4, r"batch size 6 .* 4", id="batch_not_divisible_names_sizes"),
     pytest.param(4, 4, 4, "zb_h1", 2, "m=2", id="too_few_microbatches_for_schedule"),
     pytest.param(3, 4, 2, "1f1b", 2, "multiple of the pipeline size p=2",
                  id="blocks_must_divide_into_stages")],
)  # fmt: skip
def test_sizes_that_do_not_fit(blocks, rows, p, schedule, m, match):
    params = make_params(blocks)
    x, t = make_batch(rows)
    with pytest.raises(ValueError, match=match):
        pipeline_value_and_grad(
            block, head_loss, params, x, t, mesh=pp_mesh(p), schedule=schedule,
            num_microbatches=m, first_fn=embed,
        )  # fmt: skip


def test_stage_count_must_divide_devices():
    with pytest.raises(ValueError, match=r"pp=3 = 3 does not divide the world size 8"):
        jaxpg.ParallelDims(pp=3)


def test_parallel_dims_is_the_pipeline_mesh():
    """A ParallelDims runs the pipeline over its pp axis and its one data-parallel axis,
    with the batch split over the replicas as on a plain ("dp", "pp") mesh."""
    params = make_params(2)
    x, t = make_batch(16)
    assert_matches_reference(params, x, t, mesh=jaxpg.ParallelDims(dp_replicate=4, pp=2),
                             schedule="1f1b", num_microbatches=2)


def test_stage_shapes_that_do_not_chain():
    def widening(w, x):
        return jnp.concatenate([x @ w, x], axis=-1)

    params = jnp.ones((2, D, D))
    x = jnp.ones((4, D))
    with pytest.raises(ValueError, match=r"stage 0 .* float32\[2,16\].* stage 1 .* float32\[2,8\]"):
        pipeline_value_and_grad(
            widening, lambda _, y, t: jnp.mean(y), params, x, x, mesh=pp_mesh(2),
            schedule="gpipe", num_microbatches=2,
        )  # fmt: skip


def test_remat_must_be_a_bool():
    x, t = make_batch(4)
    with pytest.raises(TypeError, match="remat='yes' must be True or False"):
        pipeline_value_and_grad(
            block, head_loss, make_params(2), x, t, mesh=pp_mesh(2), schedule="1f1b",
            num_microbatches=2, first_fn=embed, remat="yes",
        )  # fmt: skip


def test_mesh_without_pipeline_axis():
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    x, t = make_batch(4)
    with pytest.raises(ValueError, match="no pipeline axis 'pp'"):
        pipeline_value_and_grad(
            block, head_loss, make_params(2), x, t, mesh=mesh, num_microbatches=2
        )


def test_timetable_must_fit_mesh_and_params():
    x, t = make_batch(8)
    with pytest.raises(ValueError, match="num_stages=4, but the mesh and parameters need"):
        pipeline_value_and_grad(
            block, head_loss, make_params(2), x, t, mesh=pp_mesh(2),
            schedule=get_schedule("1f1b", 4, 4), first_fn=embed,
        )  # fmt: skip
    with pytest.raises(TypeError, match="schedule must be a schedule name or a Timetable"):
        pipeline_value_and_grad(block, head_loss, make_params(2), x, t, mesh=pp_mesh(2), schedule=3)
    with pytest.raises(ValueError, match="num_microbatches is required"):
        pipeline_value_and_grad(block, head_loss, make_params(2), x, t, mesh=pp_mesh(2))
