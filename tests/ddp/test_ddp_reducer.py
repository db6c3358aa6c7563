"""reduce_gradients over 2/4/8 simulated ranks against numpy means over ranks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpg.ddp import GradBucket, make_bucket_plan, reduce_gradients
from jaxpg.internal import fused_pmean

# meshes of 2 to 8 devices: not on one GPU (tools/gpu_check.sh)
pytestmark = pytest.mark.cpu_only

SHAPES = {
    "conv": {"kernel": (3, 3, 4, 8), "bias": (8,)},
    "dense": {"kernel": (32, 16), "bias": (16,)},
    "emb": (50, 4),
    "scale": (),
}


def _per_rank_grads(n, seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda s: rng.standard_normal((n, *s)).astype(np.float32),
        SHAPES,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def _local_shapes(tree):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), tree)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("cap_mb, first_mb", [(25, 1), (0.001, 0.0005), (1e-6, 1e-6)])
def test_reduce_equals_numpy_mean(spmd, n, cap_mb, first_mb):
    grads = _per_rank_grads(n)
    plan = make_bucket_plan(_local_shapes(grads), bucket_cap_mb=cap_mb, first_bucket_mb=first_mb)
    out, state = spmd(lambda g: reduce_gradients(g, plan, "dp"), n, grads)
    assert state is None
    for got, per_rank in zip(
        jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(grads), strict=True
    ):
        expected = per_rank.mean(axis=0)
        for r in range(n):  # every rank holds the mean
            np.testing.assert_allclose(got[r], expected, rtol=1e-5, atol=1e-6)


def test_fused_pmean_equals_numpy_mean(spmd):
    grads = _per_rank_grads(4, seed=1)
    out = spmd(lambda g: fused_pmean(g, "dp"), 4, grads)
    for got, per_rank in zip(
        jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(grads), strict=True
    ):
        np.testing.assert_allclose(got[0], per_rank.mean(axis=0), rtol=1e-5, atol=1e-6)


def test_mixed_dtypes_keep_their_dtypes(spmd):
    rng = np.random.default_rng(2)
    grads = {
        "a": rng.standard_normal((2, 5, 3)).astype(np.float32),
        "b": jnp.asarray(rng.standard_normal((2, 7)), jnp.bfloat16),
    }
    plan = make_bucket_plan(_local_shapes(grads))
    assert len(plan) == 2
    out, _ = spmd(lambda g: reduce_gradients(g, plan, "dp"), 2, grads)
    assert out["a"].dtype == np.float32 and out["b"].dtype == jnp.bfloat16
    np.testing.assert_allclose(out["a"][1], grads["a"].mean(0), rtol=1e-6)
    np.testing.assert_allclose(
        out["b"][1].astype(np.float32), np.asarray(grads["b"], np.float32).mean(0), rtol=1e-2
    )


def test_one_all_reduce_per_bucket_in_the_lowered_program():
    grads = _per_rank_grads(2)
    plan = make_bucket_plan(_local_shapes(grads), bucket_cap_mb=0.001, first_bucket_mb=0.0005)
    assert 1 < len(plan) < len(jax.tree_util.tree_leaves(grads))
    mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))

    def body(g):
        return reduce_gradients(jax.tree_util.tree_map(lambda x: x[0], g), plan, "dp")[0]

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P())
    text = jax.jit(fn).lower(grads).as_text()
    assert text.count("stablehlo.all_reduce") == len(plan)


def test_unflattened_default_hook_equals_flat_buckets():
    # DDP on CPU reduces the default hook's buckets without flat buffers (issue 12): the
    # same values as the flat path, one all_reduce per gradient instead of per bucket.
    grads = _per_rank_grads(2)
    plan = make_bucket_plan(_local_shapes(grads), bucket_cap_mb=0.001, first_bucket_mb=0.0005)
    mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))

    def run(flat):
        def body(g):
            local = jax.tree_util.tree_map(lambda x: x[0], g)
            return reduce_gradients(local, plan, "dp", flat_buffers=flat)[0]

        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P()))
        return fn(grads), fn.lower(grads).as_text()

    (flat, flat_text), (unflat, unflat_text) = run(True), run(False)
    n_leaves = len(jax.tree_util.tree_leaves(grads))
    assert flat_text.count("stablehlo.all_reduce") == len(plan) < n_leaves
    assert unflat_text.count("stablehlo.all_reduce") == n_leaves
    jax.tree_util.tree_map(np.testing.assert_array_equal, unflat, flat)
    jax.tree_util.tree_map(lambda g, x: np.testing.assert_allclose(g, x.mean(0), rtol=1e-6),
                           unflat, grads)


def test_replicated_output_spec_works_with_default_hook():
    # The default hook's result is invariant over the axis, so out_specs=P() type-checks.
    grads = {"w": np.arange(12.0, dtype=np.float32).reshape(4, 3)}
    plan = make_bucket_plan({"w": jax.ShapeDtypeStruct((1, 3), jnp.float32)})
    mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
    fn = jax.shard_map(
        lambda g: reduce_gradients(g, plan, "dp")[0], mesh=mesh, in_specs=P("dp"), out_specs=P()
    )
    np.testing.assert_allclose(jax.jit(fn)(grads)["w"], grads["w"].mean(0, keepdims=True))


def test_hook_sees_buckets_in_order_and_threads_state(spmd):
    grads = _per_rank_grads(2)
    plan = make_bucket_plan(_local_shapes(grads), bucket_cap_mb=0.001, first_bucket_mb=0.0005)
    seen = []

    def hook(count, bucket: GradBucket):
        seen.append((bucket.index, bucket.is_last, bucket.paths, bucket.buffer.shape))
        return bucket.buffer * 2, count + 1

    out, count = spmd(lambda g: reduce_gradients(g, plan, "dp", hook, jnp.int32(0)), 2, grads)
    assert [s[0] for s in seen] == list(range(len(plan)))
    assert [s[1] for s in seen] == [False] * (len(plan) - 1) + [True]
    assert [s[2] for s in seen] == [b.paths for b in plan.buckets]
    assert [s[3] for s in seen] == [(b.numel,) for b in plan.buckets]
    assert count.tolist() == [len(plan)] * 2
    for got, g in zip(
        jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(grads), strict=True
    ):
        np.testing.assert_array_equal(got, g * 2)


def test_tuple_axis_name(spmd):
    grads = {"w": np.arange(24.0, dtype=np.float32).reshape(4, 2, 3)}
    plan = make_bucket_plan({"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)})
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    fn = jax.shard_map(
        lambda g: reduce_gradients({"w": g["w"][0]}, plan, ("a", "b"))[0],
        mesh=mesh,
        in_specs=P(("a", "b")),
        out_specs=P(),
    )
    np.testing.assert_allclose(jax.jit(fn)(grads)["w"], grads["w"].mean(0), rtol=1e-6)


def test_mismatched_gradients_are_rejected(spmd):
    plan = make_bucket_plan({"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)})
    with pytest.raises(ValueError, match="do not match the bucket plan"):
        spmd(lambda g: reduce_gradients(g, plan, "dp"), 2, {"v": np.zeros((2, 2, 3), np.float32)})
    with pytest.raises(ValueError, match=r"shape \(3, 3\)"):
        spmd(lambda g: reduce_gradients(g, plan, "dp"), 2, {"w": np.zeros((2, 3, 3), np.float32)})


def test_hook_returning_a_wrong_buffer_is_rejected(spmd):
    plan = make_bucket_plan({"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)})

    def bad_hook(state, bucket):
        return bucket.buffer[:2], state

    with pytest.raises(ValueError, match="a hook must return a buffer like its input"):
        spmd(
            lambda g: reduce_gradients(g, plan, "dp", bad_hook),
            2,
            {"w": np.zeros((2, 2, 3), np.float32)},
        )


def test_bad_axis_name_and_plan():
    with pytest.raises(TypeError, match="axis_name"):
        reduce_gradients({}, make_bucket_plan({}), None)
    with pytest.raises(TypeError, match="BucketPlan"):
        reduce_gradients({}, {"not": "a plan"}, "dp")
