"""Communication hooks' arithmetic against numpy emulations of torch's hooks."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxpg.ddp import (
    GradBucket,
    PowerSGDConfig,
    PowerSGDState,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
    make_bucket_plan,
    make_comm_hook,
    noop_hook,
    reduce_gradients,
)

# meshes of 2 to 8 devices: not on one GPU (tools/gpu_check.sh)
pytestmark = pytest.mark.cpu_only


def _bucket(buffer):
    return GradBucket(
        index=0,
        buffer=buffer,
        paths=("['x']",),
        is_last=True,
        axis_name="dp",
        shapes=(buffer.shape,),
        offsets=(0,),
    )


def _apply(spmd, hook, x):
    """Runs ``hook`` on per-rank 1-D buffers ``x`` (ranks along axis 0)."""
    return spmd(lambda b: hook(None, _bucket(b))[0], x.shape[0], x)


def _data(n, size=257, seed=0, scale=3.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, size)) * scale).astype(np.float32)


@pytest.mark.parametrize("n", [2, 8])
def test_allreduce_hook_divides_then_sums(spmd, n):
    x = _data(n)
    out = _apply(spmd, allreduce_hook, x)
    expected = (x / np.float32(n)).sum(axis=0, dtype=np.float32)
    for r in range(n):
        np.testing.assert_allclose(out[r], expected, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(out[r], x.mean(axis=0), rtol=1e-5, atol=1e-6)


def _emulate_compress(x, low):
    """torch: buffer.to(low).div_(world_size); all_reduce in `low`; copy_ back."""
    n = x.shape[0]
    compressed = x.astype(low) / np.array(n, low)
    total = compressed[0]
    for r in range(1, n):
        total = (total + compressed[r]).astype(low)
    return total.astype(np.float32)


@pytest.mark.parametrize(
    "hook, low", [(fp16_compress_hook, np.float16), (bf16_compress_hook, ml_dtypes.bfloat16)]
)
def test_compress_hooks_match_numpy_emulation_exactly_on_two_ranks(spmd, hook, low):
    x = _data(2)
    out = _apply(spmd, hook, x)
    assert out.dtype == np.float32
    expected = _emulate_compress(x, low)
    np.testing.assert_array_equal(out[0], expected)
    np.testing.assert_array_equal(out[1], expected)


@pytest.mark.parametrize(
    "hook, low, rtol",
    [(fp16_compress_hook, np.float16, 2e-3), (bf16_compress_hook, ml_dtypes.bfloat16, 2e-2)],
)
def test_compress_hooks_on_eight_ranks(spmd, hook, low, rtol):
    # The summation order of an 8-way all-reduce is XLA's; compare to the low-precision bound.
    x = _data(8)
    out = _apply(spmd, hook, x)
    np.testing.assert_allclose(out[3], _emulate_compress(x, low), rtol=rtol, atol=rtol)
    np.testing.assert_allclose(out[3], x.mean(axis=0), rtol=rtol * 4, atol=rtol * 4)


def test_fp16_hook_casts_before_dividing(spmd):
    # 70000 overflows float16 before the division: torch's order gives inf.
    x = np.full((2, 4), 70000.0, np.float32)
    out = _apply(spmd, fp16_compress_hook, x)
    assert np.isinf(out).all()
    assert np.isfinite(_apply(spmd, bf16_compress_hook, x)).all()


def test_noop_hook_returns_the_local_buffer(spmd):
    x = _data(4)
    out = spmd(lambda b: noop_hook(None, _bucket(b))[0], 4, x)
    np.testing.assert_array_equal(out, x)


def test_hooks_pass_state_through():
    state = {"anything": 1}
    buffer = jnp.ones(3)
    assert noop_hook(state, _bucket(buffer))[1] is state


def test_grad_bucket_gradients_views():
    buffer = jnp.arange(10.0)
    bucket = GradBucket(0, buffer, ("a", "b"), True, "dp", shapes=((2, 3), (4,)), offsets=(0, 6))
    a, b = bucket.gradients()
    np.testing.assert_array_equal(a, np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(b, np.arange(6.0, 10.0))


@pytest.mark.parametrize(
    "name, hook",
    [
        ("allreduce", allreduce_hook),
        ("fp16_compress_hook", fp16_compress_hook),
        ("BF16_COMPRESS", bf16_compress_hook),
        ("noop", noop_hook),
    ],
)
def test_make_comm_hook_by_name(name, hook):
    got, init = make_comm_hook(name)
    assert got is hook
    assert init(make_bucket_plan({"w": jnp.zeros(3)})) is None


def test_make_comm_hook_power_sgd():
    hook, init = make_comm_hook("powerSGD", matrix_approximation_rank=2, start_powerSGD_iter=3)
    assert isinstance(hook, functools.partial)
    assert hook.keywords["config"] == PowerSGDConfig(
        matrix_approximation_rank=2, start_powerSGD_iter=3
    )
    state = init(make_bucket_plan({"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)}))
    assert isinstance(state, PowerSGDState)
    assert len(jax.tree_util.tree_leaves(state)) == 3  # iteration, 1 error, 1 Q memory


def test_make_comm_hook_custom_callable(spmd):
    def double(count, bucket):
        return bucket.buffer * 2, count + 1

    hook, init = make_comm_hook(double, init_state_fn=lambda plan: jnp.int32(len(plan)))
    plan = make_bucket_plan({"w": jax.ShapeDtypeStruct((3,), jnp.float32)})
    state = init(plan)
    out, state = spmd(
        lambda g, s: reduce_gradients(g, plan, "dp", hook, s),
        2,
        {"w": np.ones((2, 3), np.float32)},
        np.array([state, state]),
    )
    np.testing.assert_array_equal(out["w"], 2 * np.ones((2, 3)))
    assert state.tolist() == [2, 2]


def test_make_comm_hook_errors():
    with pytest.raises(ValueError, match="name_or_callable='sparse'"):
        make_comm_hook("sparse")
    with pytest.raises(TypeError, match="takes no configuration"):
        make_comm_hook("allreduce", rank=2)
    with pytest.raises(TypeError, match="functools.partial"):
        make_comm_hook(noop_hook, rank=2)
    with pytest.raises(TypeError, match="name_or_callable=3"):
        make_comm_hook(3)
    with pytest.raises(TypeError, match="unexpected keyword"):
        make_comm_hook("powerSGD", rank=2)
