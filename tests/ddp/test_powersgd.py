"""PowerSGD: one step against numpy torch-algorithm math, and convergence with error feedback."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpg.ddp import (
    PowerSGDConfig,
    PowerSGDState,
    init_powerSGD_state,
    make_bucket_plan,
    make_comm_hook,
    powerSGD_compression_stats,
    powerSGD_hook,
    reduce_gradients,
)
from jaxpg.ddp.powersgd import orthogonalize

# meshes of 2 to 8 devices: not on one GPU (tools/gpu_check.sh)
pytestmark = pytest.mark.cpu_only

# One float32 bucket: two compressed matrices, a bias and a scalar.
SHAPES = {"a_w": (16, 12), "b_bias": (12,), "c_w": (8, 5, 4), "d_s": ()}
CONFIG = PowerSGDConfig(matrix_approximation_rank=2, start_powerSGD_iter=3)


def np_orthogonalize(matrix, epsilon=0.0):
    """torch's _orthogonalize_gram_schmidt on one matrix, in float64."""
    matrix = matrix.copy()
    for i in range(matrix.shape[1]):
        col = matrix[:, i : i + 1]
        col /= np.linalg.norm(col) + epsilon
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1 :]
            rest -= np.sum(col * rest, axis=0, keepdims=True) * col
    return matrix


def np_powersgd_step(buffers, errors, q_memory, shapes, rank, min_rate):
    """torch's powerSGD_hook (warm start, error feedback) over all ranks at once."""
    world = len(buffers)
    inputs = [b + e for b, e in zip(buffers, errors, strict=True)]
    sizes = [int(np.prod(s)) for s in shapes]
    offsets = np.cumsum([0] + sizes[:-1])
    views = [
        [x[o : o + s].reshape(shape) for o, s, shape in zip(offsets, sizes, shapes, strict=True)]
        for x in inputs
    ]
    layout = []
    for shape in shapes:
        if len(shape) < 1:
            layout.append(None)
            continue
        n, m = shape[0], int(np.prod(shape[1:]))
        r = min(n, m, rank)
        layout.append((n, m, r) if (n + m) * r * min_rate < n * m else None)
    out = [None] * len(shapes)
    q_offset, new_qs = 0, []
    for t, lay in enumerate(layout):
        if lay is None:
            out[t] = sum(v[t] for v in views).reshape(-1) / world
            continue
        n, m, r = lay
        q = np_orthogonalize(q_memory[q_offset : q_offset + m * r].reshape(m, r))
        q_offset += m * r
        mats = [v[t].reshape(n, m) for v in views]
        p = np_orthogonalize(sum(mat @ q for mat in mats))
        q_new = sum(mat.T @ p for mat in mats) / world
        new_qs.append(q_new.reshape(-1))
        out[t] = (p @ q_new.T).reshape(-1)
    out = np.concatenate(out)
    return out, [x - out for x in inputs], np.concatenate(new_qs)


def _stack(tree, n):
    return jax.tree_util.tree_map(lambda x: np.stack([np.asarray(x)] * n), tree)


def _per_rank_grads(n, seed):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal((n, *s)).astype(np.float32) for k, s in SHAPES.items()}


def _local_plan(grads):
    return make_bucket_plan(
        jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), grads)
    )


def test_layout_and_stats_follow_torch_should_compress():
    plan = _local_plan(_per_rank_grads(1, 0))
    rate, before, after = powerSGD_compression_stats(plan, CONFIG)
    assert before == 16 * 12 + 12 + 8 * 20 + 1
    assert after == (16 + 12) * 2 + 12 + (8 + 20) * 2 + 1
    assert rate == pytest.approx(before / after)
    state = init_powerSGD_state(plan, CONFIG)
    assert state.q_memory[0].shape == ((12 + 20) * 2,)
    assert state.errors[0].shape == (before,)


def test_one_compressed_step_matches_numpy_torch_algorithm(spmd):
    n = 2
    grads = _per_rank_grads(n, seed=1)
    plan = _local_plan(grads)
    rng = np.random.default_rng(2)
    numel = plan.buckets[0].numel
    errors = (0.1 * rng.standard_normal((n, numel))).astype(np.float32)
    q_memory = rng.standard_normal((12 + 20) * 2).astype(np.float32)
    state = PowerSGDState(
        iteration=np.full((n,), CONFIG.start_powerSGD_iter + 1, np.int32),  # warm path
        errors=(errors,),
        q_memory=(np.stack([q_memory] * n),),
    )
    hook = functools.partial(powerSGD_hook, config=CONFIG)
    out, new_state = spmd(lambda g, s: reduce_gradients(g, plan, "dp", hook, s), n, grads, state)

    buffers = [
        np.concatenate([grads[k][r].reshape(-1) for k in sorted(SHAPES)]).astype(np.float64)
        for r in range(n)
    ]
    exp_out, exp_errors, exp_q = np_powersgd_step(
        buffers,
        list(errors.astype(np.float64)),
        q_memory.astype(np.float64),
        [SHAPES[k] for k in sorted(SHAPES)],
        rank=2,
        min_rate=2,
    )
    got = [np.concatenate([out[k][r].reshape(-1) for k in sorted(SHAPES)]) for r in range(n)]
    for r in range(n):
        np.testing.assert_allclose(got[r], exp_out, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(new_state.errors[0][r], exp_errors[r], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(new_state.q_memory[0][r], exp_q, rtol=1e-4, atol=1e-5)
    assert new_state.iteration.tolist() == [CONFIG.start_powerSGD_iter + 2] * n
    # Biases and scalars are averaged exactly; their error is local minus mean.
    np.testing.assert_allclose(
        out["b_bias"][0], grads["b_bias"].mean(0) + errors[:, 192:204].mean(0), rtol=1e-5, atol=1e-6
    )


def test_plain_allreduce_before_start(spmd):
    n = 4
    grads = _per_rank_grads(n, seed=3)
    plan = make_bucket_plan(
        jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), grads),
        bucket_cap_mb=0.0005,
        first_bucket_mb=0.0005,
    )
    assert len(plan) > 1
    hook, init = make_comm_hook("powerSGD", matrix_approximation_rank=2, start_powerSGD_iter=3)
    state = _stack(init(plan), n)
    out, new_state = spmd(lambda g, s: reduce_gradients(g, plan, "dp", hook, s), n, grads, state)
    for k in SHAPES:
        np.testing.assert_allclose(out[k][1], grads[k].mean(0), rtol=1e-5, atol=1e-6)
    assert new_state.iteration.tolist() == [1] * n  # one step, counted at the last bucket
    for e in new_state.errors:
        assert not e.any()


def test_first_compressed_step_recovers_an_exactly_low_rank_mean(spmd):
    # Every rank's matrix is u v_r^T, so the mean is rank 1 and one power step is exact.
    n = 4
    rng = np.random.default_rng(4)
    u = rng.standard_normal(24)
    grads = {
        "w": np.stack([np.outer(u, rng.standard_normal(18)) for _ in range(n)]).astype(np.float32)
    }
    plan = make_bucket_plan({"w": jax.ShapeDtypeStruct((24, 18), jnp.float32)})
    config = PowerSGDConfig(matrix_approximation_rank=1, start_powerSGD_iter=0)
    hook = functools.partial(powerSGD_hook, config=config)
    state = _stack(init_powerSGD_state(plan, config), n)
    out, new_state = spmd(lambda g, s: reduce_gradients(g, plan, "dp", hook, s), n, grads, state)
    for r in range(n):
        np.testing.assert_allclose(out["w"][r], grads["w"].mean(0), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(new_state.errors[0].sum(0), 0, atol=1e-4)


def _run_training(spmd, hook, init, steps=200, n=4, lr=0.1):
    """Least squares on n ranks (each its own data), SGD on the reduced gradients."""
    rng = np.random.default_rng(5)
    w_true = rng.standard_normal((32, 16)).astype(np.float32)
    x = rng.standard_normal((n, 64, 32)).astype(np.float32)
    y = (x @ w_true + 0.01 * rng.standard_normal((n, 64, 16))).astype(np.float32)
    params = {"w": np.zeros((32, 16), np.float32), "b": np.zeros((16,), np.float32)}
    plan = make_bucket_plan(params)

    def loss_fn(p, xb, yb):
        return jnp.mean((xb @ p["w"] + p["b"] - yb) ** 2)

    def train(xb, yb, p, s):
        def step(carry, _):
            p, s = carry
            loss, g = jax.value_and_grad(loss_fn)(p, xb, yb)
            g, s = reduce_gradients(g, plan, "dp", hook, s)
            p = jax.tree_util.tree_map(lambda a, b: a - lr * b, p, g)
            return (p, s), jax.lax.pmean(loss, "dp")

        _, losses = jax.lax.scan(step, (p, s), None, length=steps)
        return losses

    losses = spmd(train, n, x, y, _stack(params, n), _stack(init(plan), n))
    return losses[0]


def test_powersgd_with_error_feedback_converges_like_allreduce(spmd):
    common = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 5}
    runs = {}
    for label, name, cfg in [
        ("allreduce", "allreduce", {}),
        ("powerSGD", "powerSGD", common),
        ("no_error_feedback", "powerSGD", {**common, "use_error_feedback": False}),
    ]:
        runs[label] = _run_training(spmd, *make_comm_hook(name, **cfg))
    base, compressed = runs["allreduce"], runs["powerSGD"]
    assert np.all(np.isfinite(compressed))
    assert compressed[-1] < 0.05 * compressed[0]
    assert compressed[-1] <= 1.2 * base[-1]
    # Error feedback is what makes rank-1 compression converge here.
    assert runs["no_error_feedback"][-1] > 5 * compressed[-1]


def test_config_validation():
    with pytest.raises(ValueError, match="matrix_approximation_rank=0"):
        PowerSGDConfig(matrix_approximation_rank=0)
    with pytest.raises(TypeError, match="start_powerSGD_iter=1.5"):
        PowerSGDConfig(start_powerSGD_iter=1.5)
    with pytest.raises(ValueError, match="start_powerSGD_iter=-1"):
        PowerSGDConfig(start_powerSGD_iter=-1)
    with pytest.raises(ValueError, match="min_compression_rate"):
        PowerSGDConfig(min_compression_rate=-2)


def test_hook_rejects_missing_or_foreign_state(spmd):
    plan = make_bucket_plan({"w": jax.ShapeDtypeStruct((24, 18), jnp.float32)})
    other = make_bucket_plan({"w": jax.ShapeDtypeStruct((4, 18), jnp.float32)})
    grads = {"w": np.zeros((2, 24, 18), np.float32)}
    with pytest.raises(TypeError, match="init_powerSGD_state"):
        spmd(lambda g: reduce_gradients(g, plan, "dp", powerSGD_hook, None), 2, grads)
    state = _stack(init_powerSGD_state(other), 2)
    with pytest.raises(ValueError, match="rebuild"):
        spmd(lambda g, s: reduce_gradients(g, plan, "dp", powerSGD_hook, s), 2, grads, state)


def test_orthogonalize_matches_numpy():
    m = np.random.default_rng(6).standard_normal((9, 3)).astype(np.float32)
    got = np.asarray(orthogonalize(jnp.asarray(m)))
    np.testing.assert_allclose(got, np_orthogonalize(m.astype(np.float64)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.T @ got, np.eye(3), atol=1e-5)


@pytest.mark.parametrize("start", [0, 5])
def test_reduced_gradients_are_replicated_under_check_vma(start):
    # Both branches of the hook return a buffer that is invariant over the axis,
    # so the gradients can leave shard_map with out_specs=P(); the state is per rank.
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    n = 2
    plan = make_bucket_plan({"w": jax.ShapeDtypeStruct((24, 18), jnp.float32)})
    hook, init = make_comm_hook("powerSGD", start_powerSGD_iter=start)
    mesh = Mesh(np.array(jax.devices()[:n]), ("dp",))

    def body(g, s):
        s = jax.tree_util.tree_map(lambda x: x[0], s)
        out, s = reduce_gradients({"w": g[0]}, plan, "dp", hook, s)
        return out["w"], jax.tree_util.tree_map(lambda x: x[None], s)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=(P(), P("dp"))))
    g = np.random.default_rng(7).standard_normal((n, 24, 18)).astype(np.float32)
    out, state = fn(g, _stack(init(plan), n))
    assert out.shape == (24, 18) and state.iteration.tolist() == [1, 1]


def test_buckets_without_compressible_or_plain_gradients(spmd):
    # Tiny caps put the bias and the matrix in buckets of their own.
    n = 2
    rng = np.random.default_rng(8)
    grads = {
        "a_bias": rng.standard_normal((n, 16)).astype(np.float32),
        "b_w": rng.standard_normal((n, 24, 18)).astype(np.float32),
    }
    plan = make_bucket_plan(
        {
            "a_bias": jax.ShapeDtypeStruct((16,), jnp.float32),
            "b_w": jax.ShapeDtypeStruct((24, 18), jnp.float32),
        },
        bucket_cap_mb=1e-6,
        first_bucket_mb=1e-6,
    )
    assert [b.paths for b in plan.buckets] == [("['b_w']",), ("['a_bias']",)]
    hook, init = make_comm_hook("powerSGD", start_powerSGD_iter=0)
    state = _stack(init(plan), n)
    assert state.q_memory[1].shape == (n, 0)
    out, new_state = spmd(lambda g, s: reduce_gradients(g, plan, "dp", hook, s), n, grads, state)
    np.testing.assert_allclose(out["a_bias"][0], grads["a_bias"].mean(0), rtol=1e-6)
    assert np.isfinite(out["b_w"]).all()
    np.testing.assert_allclose(out["b_w"][0], out["b_w"][1])
    # The uncompressed bucket's errors are local minus mean: they cancel over ranks.
    np.testing.assert_allclose(new_state.errors[1].sum(0), 0, atol=1e-5)
    assert np.abs(new_state.errors[0]).max() > 0
