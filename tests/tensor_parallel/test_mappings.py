"""Megatron's region operators (jaxpg.tensor_parallel.mappings): forward values and custom
gradients against numpy over all ranks' local arrays.

Each operator runs under ``jaxpg.spmd`` on a group of N = 4 ranks; the loss is
``sum_r <G_r, out_r>`` with a different cotangent ``G_r`` on every rank, so ``jax.grad``
gives each rank's input gradient ``vjp_r(G)``, which numpy computes from the table in the
module's docstring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpg
from jaxpg.tensor_parallel import mappings as M

N = 4


def chunk(a: np.ndarray, r: int, dim: int) -> np.ndarray:
    """Rank r's chunk of ``a`` along ``dim`` (N equal chunks)."""
    return np.split(a, N, axis=dim)[r]


def cat(parts: list[np.ndarray], dim: int) -> np.ndarray:
    return np.concatenate(parts, axis=dim)


def run(op, x: np.ndarray, g: np.ndarray, group) -> tuple[np.ndarray, np.ndarray]:
    """(out, dx): every rank's output and its input's gradient for cotangents ``g``."""
    f = jaxpg.spmd(lambda a: op(a, group.axis_name), group=group)

    def loss(a):
        out = f(a)
        return jnp.sum(out * g), out

    dx, out = jax.jit(jax.grad(loss, has_aux=True))(jnp.asarray(x))
    return np.asarray(out), np.asarray(dx)


def data(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(N, *shape)).astype(np.float32)


@pytest.fixture
def tp():
    return jaxpg.new_group(list(range(N)))


# Each case: (operator on (local array, axis), local input shape, local output shape,
#             numpy forward over all ranks X -> [out_r], numpy backward (X, G) -> [dx_r]).
CASES = {
    "copy_to_tensor_parallel_region (f)": (
        M.copy_to_tensor_parallel_region, (3, 4), (3, 4),
        lambda X: [X[r] for r in range(N)],
        lambda X, G: [G.sum(0) for r in range(N)]),
    "reduce_from_tensor_parallel_region (g)": (
        M.reduce_from_tensor_parallel_region, (3, 4), (3, 4),
        lambda X: [X.sum(0) for r in range(N)],
        lambda X, G: [G[r] for r in range(N)]),
    "scatter_to_tensor_parallel_region": (
        M.scatter_to_tensor_parallel_region, (3, 8), (3, 2),
        lambda X: [chunk(X[r], r, -1) for r in range(N)],
        lambda X, G: [cat(list(G), -1) for r in range(N)]),
    "gather_from_tensor_parallel_region": (
        M.gather_from_tensor_parallel_region, (3, 2), (3, 8),
        lambda X: [cat(list(X), -1) for r in range(N)],
        lambda X, G: [chunk(G[r], r, -1) for r in range(N)]),
    "scatter_to_sequence_parallel_region": (
        M.scatter_to_sequence_parallel_region, (2, 8, 3), (2, 2, 3),
        lambda X: [chunk(X[r], r, 1) for r in range(N)],
        lambda X, G: [cat(list(G), 1) for r in range(N)]),
    "gather_from_sequence_parallel_region": (
        M.gather_from_sequence_parallel_region, (2, 2, 3), (2, 8, 3),
        lambda X: [cat(list(X), 1) for r in range(N)],
        lambda X, G: [chunk(G.sum(0), r, 1) for r in range(N)]),  # reduce-scatter
    "gather_from_sequence_parallel_region(tensor_parallel_output_grad=False)": (
        lambda a, axis: M.gather_from_sequence_parallel_region(
            a, axis, tensor_parallel_output_grad=False), (2, 2, 3), (2, 8, 3),
        lambda X: [cat(list(X), 1) for r in range(N)],
        lambda X, G: [chunk(G[r], r, 1) for r in range(N)]),  # split
    "reduce_scatter_to_sequence_parallel_region": (
        M.reduce_scatter_to_sequence_parallel_region, (2, 8, 3), (2, 2, 3),
        lambda X: [chunk(X.sum(0), r, 1) for r in range(N)],
        lambda X, G: [cat(list(G), 1) for r in range(N)]),
    "all_to_all_region(split_dim=0, concat_dim=1)": (
        lambda a, axis: M.all_to_all_region(a, axis, 0, 1), (8, 3), (2, 12),
        lambda X: [cat([chunk(X[s], r, 0) for s in range(N)], 1) for r in range(N)],
        lambda X, G: [cat([chunk(G[s], r, 1) for s in range(N)], 0) for r in range(N)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_custom_gradient_equal_numpy(tp, name):
    op, shape, out_shape, forward, backward = CASES[name]
    x, g = data(shape, 0), data(out_shape, 1)
    out, dx = run(op, x, g, tp)
    want = np.stack(forward(x))
    assert out.shape == want.shape == (N, *out_shape)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    want_dx = np.stack(backward(x, g))
    assert dx.shape == want_dx.shape == x.shape
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use", ["both", "first", "second"])
def test_gather_with_partial_twin_splits_the_first_and_reduce_scatters_the_second(tp, use):
    x, g1, g2 = data((2, 3), 0), data((8, 3), 1), data((8, 3), 2)
    w1, w2 = float(use in ("both", "first")), float(use in ("both", "second"))
    f = jaxpg.spmd(lambda a: M.gather_with_partial_twin(a, tp.axis_name, 0), group=tp)

    def loss(a):
        first, second = f(a)
        terms = []
        if w1:
            terms.append(jnp.sum(first * g1))
        if w2:
            terms.append(jnp.sum(second * g2))
        return sum(terms), (first, second)

    dx, (full, twin) = jax.jit(jax.grad(loss, has_aux=True))(jnp.asarray(x))
    want = np.stack([cat(list(x), 0)] * N)
    np.testing.assert_allclose(np.asarray(full), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(twin), want, rtol=1e-6)
    dx = np.asarray(dx)
    want_dx = np.stack([w1 * chunk(g1[r], r, 0) + w2 * chunk(g2.sum(0), r, 0)
                        for r in range(N)])
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)


def per_rank(op, group):
    """``op(local array, axis)`` on every rank of ``group``, jitted."""
    return jax.jit(jaxpg.spmd(lambda a: op(a, group.axis_name), group=group))


def test_integer_arrays_move_without_a_gradient_rule(tp):
    x = np.arange(N * 2 * 8, dtype=np.int32).reshape(N, 2, 8)
    f = per_rank(M.scatter_to_tensor_parallel_region, tp)
    np.testing.assert_array_equal(np.asarray(f(x)), np.stack([chunk(x[r], r, -1)
                                                              for r in range(N)]))
    f = per_rank(lambda a, axis: M.gather_from_sequence_parallel_region(a, axis, dim=0), tp)
    np.testing.assert_array_equal(np.asarray(f(x)), np.stack([cat(list(x), 0)] * N))


def test_bad_dims_name_the_dimension_and_the_fix(tp):
    f = per_rank(M.scatter_to_tensor_parallel_region, tp)
    with pytest.raises(ValueError, match=r"cannot split dimension 1 of size 6 over the 4 ranks "
                                         r".*divisible by 4"):
        f(jnp.ones((N, 3, 6)))
    f = per_rank(M.reduce_scatter_to_sequence_parallel_region, tp)
    with pytest.raises(ValueError, match=r"cannot reduce-scatter dimension 1 of size 6 .*"
                                         r"divisible by 4"):
        f(jnp.ones((N, 2, 6)))
    f = per_rank(lambda a, axis: M.gather_from_tensor_parallel_region(a, axis, dim=2), tp)
    with pytest.raises(ValueError, match=r"dim=2 is out of range for an array of shape \(3, 6\)"):
        f(jnp.ones((N, 3, 6)))
