"""``grouped_matmul``, every implementation this platform runs, against numpy: the output
and both gradients, for groups that are empty, cross tile boundaries, fill one tile or
leave a tail of unused rows (the worst-case buffers' case)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpg.expert_parallel.grouped_matmul import (
    TILE_ROWS,
    grouped_matmul,
    mosaic_applies,
    resolve_grouped_matmul,
)

T = TILE_ROWS
CASES = {  # rows, group sizes
    "tail-and-empty": (3 * T + 44, [0, T + 2, 1, T - 3, 0]),
    "one-partial-tile": (T // 2 + 3, [5, 0, 20]),
    "aligned": (2 * T, [T, 0, T]),
    "all-empty": (T + 1, [0, 0]),
    "one-group-all-rows": (2 * T + 7, [2 * T + 7]),
}


def _numpy(lhs, rhs, sizes, d_out):
    """Output and gradients of ``sum(out · d_out)`` row by row, in float64."""
    lhs, rhs, d_out = (np.asarray(a, np.float64) for a in (lhs, rhs, d_out))
    out, d_lhs, d_rhs = np.zeros((lhs.shape[0], rhs.shape[2])), np.zeros_like(lhs), \
        np.zeros_like(rhs)
    start = 0
    for e, size in enumerate(sizes):
        rows = slice(start, start + size)
        out[rows] = lhs[rows] @ rhs[e]
        d_lhs[rows] = d_out[rows] @ rhs[e].T
        d_rhs[e] = lhs[rows].T @ d_out[rows]
        start += size
    return out, d_lhs, d_rhs


def _run(impl, lhs, rhs, sizes, d_out):
    group_sizes = jnp.asarray(sizes, jnp.int32)

    def loss(lhs, rhs):
        out = grouped_matmul(lhs, rhs, group_sizes, impl=impl)
        return jnp.sum(out.astype(jnp.float32) * d_out), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(lhs, rhs)
    return out, *grads


def _inputs(rows, experts, k, n, dtype, seed=0):
    r = np.random.default_rng(seed)
    lhs = r.normal(size=(rows, k)).astype(np.float32)
    rhs = (r.normal(size=(experts, k, n)) / np.sqrt(k)).astype(np.float32)
    d_out = r.normal(size=(rows, n)).astype(np.float32)
    return jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), d_out


FLOAT32_IMPLS = ["xla", "tiled"]  # every platform


@pytest.mark.parametrize("impl", FLOAT32_IMPLS)
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_matmul_equals_numpy(impl, case):
    rows, sizes = CASES[case]
    lhs, rhs, d_out = _inputs(rows, len(sizes), 24, 40, jnp.float32)
    got = _run(impl, lhs, rhs, sizes, d_out)
    want = _numpy(lhs, rhs, sizes, d_out)
    for name, g, w in zip(("out", "d_lhs", "d_rhs"), got, want):
        assert g.shape == w.shape and g.dtype == jnp.float32, name
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5, err_msg=name)
    assert not np.any(np.asarray(got[0])[sum(sizes):]), "the unused tail must come out zero"


def test_mosaic_kernels_equal_numpy_in_bfloat16_where_they_run():
    """On a Hopper GPU: jax's Mosaic kernels with this module's VJP. Elsewhere: 'mosaic' is
    refused with the reason, and 'auto' takes the tiled loop on CPU and XLA's elsewhere."""
    rows, sizes, k, n = 3 * T + 44, [0, T + 2, 1, T - 3, 0], 128, 256
    lhs, rhs, d_out = _inputs(rows, len(sizes), k, n, jnp.bfloat16, seed=1)
    why_not = mosaic_applies(lhs, rhs)
    if why_not is not None:
        with pytest.raises(ValueError, match="grouped_matmul='mosaic' cannot run here"):
            _run("mosaic", lhs, rhs, sizes, d_out)
        want_auto = "tiled" if jax.default_backend() == "cpu" else "xla"
        assert resolve_grouped_matmul("auto", lhs, rhs) == want_auto
        return
    assert resolve_grouped_matmul("auto", lhs, rhs) == "mosaic"
    got = _run("mosaic", lhs, rhs, sizes, d_out)
    want = _numpy(np.asarray(lhs, np.float32), np.asarray(rhs, np.float32), sizes, d_out)
    for name, g, w in zip(("out", "d_lhs", "d_rhs"), got, want):
        assert g.shape == w.shape and g.dtype == jnp.bfloat16, name
        scale = np.max(np.abs(w)) or 1.0
        np.testing.assert_allclose(np.asarray(g, np.float32) / scale, w / scale, atol=2e-2,
                                   err_msg=name)
    assert not np.any(np.asarray(got[0], np.float32)[sum(sizes):])


def test_float32_is_refused_by_mosaic_and_bad_names_by_all():
    lhs, rhs, _ = _inputs(8, 2, 128, 128, jnp.float32)
    sizes = jnp.asarray([4, 4], jnp.int32)
    with pytest.raises(ValueError, match=r"grouped_matmul='mosaic' cannot run here: "):
        grouped_matmul(lhs, rhs, sizes, impl="mosaic")
    with pytest.raises(ValueError, match=r"grouped_matmul='dense' must be one of 'auto', "
                                         r"'xla', 'tiled', 'mosaic'"):
        grouped_matmul(lhs, rhs, sizes, impl="dense")
