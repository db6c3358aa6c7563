"""SPMD collectives compose with jax.jit and jax.grad: gradients against hand derivations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import make_group, members

import jaxpg

KINDS = ["world", "subset", "enumeration"]


def _loss(per_rank, x):
    # sum over ranks of each rank's scalar output: the SPMD program's total
    return jnp.sum(jaxpg.spmd(per_rank)(x))


@pytest.mark.parametrize("kind", KINDS)
def test_grad_all_reduce(kind):
    group, family = make_group(kind)
    w = np.linspace(1, 2, 8, dtype=np.float32)
    x = jnp.arange(8.0, dtype=jnp.float32)[:, None] + 1
    f = lambda v: jnp.sum(jaxpg.all_reduce(v, group=group) ** 2)
    g = jax.jit(jax.grad(lambda x: jnp.sum(jnp.asarray(w)[:, None] * jaxpg.spmd(f)(x)[:, None])))(x)
    # d/dx_r sum_s w_s (sum_{t in S(s)} x_t)^2 = sum_{s in S(r)} 2 w_s * total(S)
    want = np.zeros(8, np.float32)
    xs = np.asarray(x)[:, 0]
    for sub in family:
        tot = xs[sub].sum()
        for r in sub:
            want[r] = sum(2 * w[s] * tot for s in sub)
    for r in set(range(8)) - set(members(family)):
        want[r] = 2 * w[r] * xs[r]
    np.testing.assert_allclose(np.asarray(g)[:, 0], want, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_grad_all_gather(kind):
    group, family = make_group(kind)
    x = jnp.arange(8.0)[:, None] + 1
    k = len(family[0])
    coef = jnp.arange(1.0, k + 1)

    def per_rank(v):
        parts = jaxpg.all_gather(v, group=group)
        return sum(coef[i] * parts[i][0] for i in range(k))

    g = jax.grad(lambda x: jnp.sum(jaxpg.spmd(per_rank)(x)))(x)
    want = np.zeros(8)
    for sub in family:
        for j, r in enumerate(sub):
            want[r] = len(sub) * (j + 1)  # each of the k members reads x_r with coef j+1
    for r in set(range(8)) - set(members(family)):
        want[r] = np.nan
    got = np.asarray(g)[:, 0]
    mem = members(family)
    np.testing.assert_allclose(got[mem], want[mem], rtol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_grad_all_to_all_and_permute(kind):
    group, family = make_group(kind)
    k = len(family[0])
    x = jnp.arange(8.0 * k).reshape(8, k) + 1

    def per_rank(v):
        out = jaxpg.all_to_all([v[i:i + 1] for i in range(k)], group=group)
        moved = jaxpg.permute(v, [(0, 1)], group=group)
        return sum((i + 1.0) * out[i][0] for i in range(k)) + jnp.sum(moved * 3.0)

    g = np.asarray(jax.grad(lambda x: jnp.sum(jaxpg.spmd(per_rank)(x)))(x))
    for sub in family:
        for j, r in enumerate(sub):
            # x_r[i] goes to member i, which weights what it got from member j by (j + 1)
            want = np.full(k, j + 1.0)
            if j == 0:  # group rank 0's whole vector goes to group rank 1, weighted 3
                want += 3.0
            np.testing.assert_allclose(g[r], want, rtol=1e-6)


def test_spmd_rank_is_traced_and_jit_caches():
    f = jax.jit(jaxpg.spmd(lambda v: v * jaxpg.get_rank() + jaxpg.get_world_size()))
    np.testing.assert_array_equal(np.asarray(f(jnp.ones((8, 1))))[:, 0], np.arange(8) + 8)
    g = jaxpg.new_group([2, 5])
    h = jaxpg.spmd(lambda v: v * jaxpg.get_rank(g))
    np.testing.assert_array_equal(np.asarray(h(jnp.ones((8, 1))))[:, 0],
                                  [-1, -1, 0, -1, -1, 1, -1, -1])
