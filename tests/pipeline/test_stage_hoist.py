"""Hoisting a stage's parameter-only layout work: same values and gradients, and no weight
slices left in the per-microbatch programs."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpg.pipeline.process.action_programs import action_programs
from jaxpg.pipeline.stage.hoist import hoist_stage

D, H, L, ROWS = 8, 40, 3, 4


def stacked_stage(w, x):
    for i in range(w["w1"].shape[0]):
        x = x + jnp.tanh(x @ w["w1"][i] + w["b"][i]) @ w["w2"][i].T
    return x


def params(seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    return {"w1": jax.random.normal(k[0], (L, D, H)) * 0.3,
            "b": jax.random.normal(k[1], (L, H)) * 0.1,
            "w2": jax.random.normal(k[2], (L, D, H)) * 0.3}  # fmt: skip


def test_hoisted_stage_gives_the_same_output_and_gradients():
    p = params()
    x = jax.random.normal(jax.random.key(1), (ROWS, D))
    h = hoist_stage(stacked_stage, p, x)
    assert h is not None and set(h.hoisted) <= {"slice", "squeeze", "transpose"}
    assert {s.shape for s in h.q_structs} == {(D, H), (H,), (H, D)}  # w2[i].T hoisted too
    np.testing.assert_array_equal(h.stage(h.prepare(p), x), stacked_stage(p, x))
    dy = jax.random.normal(jax.random.key(2), (ROWS, D))
    want = jax.vjp(stacked_stage, p, x)[1](dy)[0]
    dq = jax.vjp(h.stage, h.prepare(p), x)[1](dy)[0]
    got = h.grad_back(dq)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), got, want)


def test_nothing_to_hoist():
    def plain(w, x):
        return jnp.tanh(x @ w["w"])

    x = jnp.ones((ROWS, D))
    assert hoist_stage(plain, {"w": jnp.ones((D, D))}, x) is None

    def indexed_by_data(w, x):  # the index depends on the activation: not parameter-only
        i = jnp.argmax(x[0, :2])
        return jnp.tanh(x @ jax.lax.dynamic_index_in_dim(w, i, keepdims=False))

    assert hoist_stage(indexed_by_data, jnp.ones((2, D, D)), x) is None


@pytest.mark.cpu_only  # reads XLA:CPU's optimized program
@pytest.mark.parametrize("hoist", [False, True])
def test_forward_program_slices_no_weights_once_hoisted(hoist):
    p = params()
    act = jax.ShapeDtypeStruct((ROWS, D), jnp.float32)
    if hoist:
        h = hoist_stage(stacked_stage, p, act)
        fn, one, pc = h.stage, h.q_structs, tuple(a[None] for a in h.prepare(p))
    else:
        fn, one, pc = stacked_stage, p, jax.tree.map(lambda a: a[None], p)
    progs = action_programs(fn, lambda _, y, t: jnp.mean((y - t) ** 2), None, remat=False,
                            split_backward=False, one_stage=one, act=act, rows=ROWS)
    hlo = progs.forward.lower(pc, jnp.ones((ROWS, D))).compile().as_text()
    weight_slices = [line for line in hlo.splitlines()
                     if re.search(rf"= f32\[{D},{H}\]\S* (fusion|slice|copy)\(", line)]
    assert bool(weight_slices) != hoist, weight_slices
