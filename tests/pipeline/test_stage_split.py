"""split_stage: F, B and W pieces against jax.vjp, with the work divided, not repeated."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpg.pipeline.stage.split import ELEMENTWISE, split_stage

D = 8


def mlp(w, x):
    return x + jax.nn.gelu(x @ w["w1"] + w["b1"]) @ w["w2"] + w["b2"]


def make(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    w = {
        "w1": jax.random.normal(k[0], (D, 4 * D)),
        "b1": jnp.ones(4 * D),
        "w2": jax.random.normal(k[1], (4 * D, D)),
        "b2": jnp.ones(D),
    }
    return w, jax.random.normal(k[2], (3, D)), jax.random.normal(k[3], (3, D))


def close(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5), a, b)


@pytest.mark.parametrize("split", [False, True])
def test_pieces_match_vjp_and_never_call_the_stage(split):
    w, x, dy = make()
    calls = []

    def counted(w, x):
        calls.append(1)
        return mlp(w, x)

    pieces = split_stage(counted, w, x, split)
    traced = len(calls)
    y, res = pieces.forward(w, x)
    dp, dx, wres = pieces.backward(w, x, dy, res)
    if split:
        assert dp is None
        dp = pieces.weight(w, x, dy, res, wres)
    assert len(calls) == traced, "a piece ran the stage function again (recomputation)"
    want_y, vjp = jax.vjp(mlp, w, x)
    want_dp, want_dx = vjp(dy)
    close(y, want_y)
    close(dx, want_dx)
    close(dp, want_dp)


def test_split_divides_the_backward_without_repeating_it():
    w, x, _ = make()
    whole = split_stage(mlp, w, x, False).primitives
    split = split_stage(mlp, w, x, True)

    def dots(names):
        return sum(n == "dot_general" for n in names)

    prims = split.primitives
    # Forward: two matmuls. Whole backward: four. Split: B two (dx), W two (dW1, dW2).
    assert dots(whole["F"]) == dots(prims["F"]) == 2
    assert dots(whole["B"]) == 4
    assert (dots(prims["B"]), dots(prims["W"])) == (2, 2)

    def heavy(names):
        return [n for n in names if n not in ELEMENTWISE]

    # B and W share out the whole backward's non-elementwise work, none of it twice.
    assert sorted(heavy(prims["B"]) + heavy(prims["W"])) == sorted(heavy(whole["B"]))
    # W is its two matmuls and nothing else: it reads what B already has at hand (the
    # hidden-layer gradient, gelu's output, the bias gradients) instead of recomputing
    # gelu (a tanh) or re-reading the hidden gradient for a bias sum.
    assert [n for n in prims["W"] if n != "transpose"] == ["dot_general", "dot_general"]
    assert prims["B"].count("tanh") == 1
    assert sorted(s.shape for s in split.wres_structs) == [(3, 4 * D), (3, 4 * D), (D,), (4 * D,)]
    # F saves one matmul result (gelu's input before the bias); gelu is recomputed.
    # Residuals are activations only: no copy of a weight is saved per microbatch.
    assert [s.shape for s in split.res_structs] == [(3, 4 * D)]


ACTIVATIONS = {
    "gelu_tanh": jax.nn.gelu,  # jax >= 0.11.2: tanh's derivative is `one_minus_square`
    "gelu_erf": partial(jax.nn.gelu, approximate=False),  # 0.12: erf's in a custom_jvp
    "silu": jax.nn.silu,  # a nested jit with several outputs
    "relu": jax.nn.relu,  # a custom_jvp function, kept as a call in the forward
    "softplus": jax.nn.softplus,
    "mish": jax.nn.mish,
    "arcsinh": jnp.arcsinh,  # stop_gradient in its derivative
}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_forward_saves_one_activation_per_microbatch(name):
    """Whatever the activation and however this jax spells its derivative (new primitives,
    nested jits, custom_jvp calls), F saves only the matmul result the activation reads:
    ``rows * 4D`` floats per microbatch, and B and W repeat no matmul."""
    act = ACTIVATIONS[name]

    def block(w, x):
        return x + act(x @ w["w1"] + w["b1"]) @ w["w2"] + w["b2"]

    w, x, dy = make()
    pieces = split_stage(block, w, x, True)
    y, res = pieces.forward(w, x)
    _, dx, wres = pieces.backward(w, x, dy, res)
    dp = pieces.weight(w, x, dy, res, wres)
    want_y, vjp = jax.vjp(block, w, x)
    want_dp, want_dx = vjp(dy)
    close(y, want_y)
    close(dx, want_dx)
    close(dp, want_dp)
    saved = sum(np.prod(s.shape) * s.dtype.itemsize for s in pieces.res_structs)
    assert saved == x.shape[0] * 4 * D * 4, [s.shape for s in pieces.res_structs]
    dots = {k: v.count("dot_general") for k, v in pieces.primitives.items()}
    assert dots == {"F": 2, "B": 2, "W": 2}


def test_pytree_activation_and_unused_parameter():
    def block(w, xs):
        a, b = xs
        return jnp.tanh(a @ w["w"]) + b, b * 2.0

    w = {"w": jnp.ones((D, D)) * 0.1, "unused": jnp.ones((5,))}
    xs = (jnp.ones((2, D)), jnp.arange(2.0 * D).reshape(2, D))
    dys = (jnp.ones((2, D)), jnp.ones((2, D)))
    pieces = split_stage(block, w, xs, True)
    y, res = pieces.forward(w, xs)
    _, dx, wres = pieces.backward(w, xs, dys, res)
    dp = pieces.weight(w, xs, dys, res, wres)
    want_y, vjp = jax.vjp(block, w, xs)
    want_dp, want_dx = vjp(dys)
    close(y, want_y)
    close(dx, want_dx)
    close(dp, want_dp)
    assert all(s.shape[0] == 2 for s in pieces.res_structs)


@pytest.mark.cpu_only  # XLA:CPU's buffer assignment (XLA:GPU's fuses the reference's adds too)
def test_weight_into_adds_one_gradient_at_a_time():
    """``weight_into`` gives ``g + weight(...)`` and, in a loop that accumulates in place
    (as the executor's), keeps one weight-gradient temporary live at a time: XLA's temp
    memory stays under two gradients, where ``g + weight(...)`` makes all six first."""
    k = jax.random.split(jax.random.key(1), 8)
    d, h, rows, layers = 64, 256, 4, 3
    w = [{"w1": jax.random.normal(k[i], (d, h)) / 8, "w2": jax.random.normal(k[i + 3], (h, d)) / 16}
         for i in range(layers)]  # fmt: skip
    x, dy = jax.random.normal(k[6], (rows, d)), jax.random.normal(k[7], (rows, d))

    def stage(w, x):
        for p in w:
            x = x + jnp.tanh(x @ p["w1"]) @ p["w2"]
        return x

    pieces = split_stage(stage, w, x, True)
    _, res = pieces.forward(w, x)
    _, _, wres = pieces.backward(w, x, dy, res)
    g = jax.tree.map(lambda a: jnp.full_like(a, 0.5), w)

    def accumulate(update):
        def run(g, w, x, dy, res, wres):
            def tick(g, i):
                return update(g, w, x * i, dy, res, wres, i), None

            return jax.lax.scan(tick, g, jnp.arange(3.0))[0]

        return jax.jit(run)

    into = accumulate(lambda g, *a: pieces.weight_into(g, *a[:-1], go=a[-1] >= 0))
    plain = accumulate(lambda g, *a: jax.tree.map(jnp.add, g, pieces.weight(*a[:-1])))
    args = (g, w, x, dy, res, wres)
    close(into(*args), plain(*args))

    def temp_bytes(fn):
        return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes

    one_grad = d * h * 4
    assert temp_bytes(plain) >= 4 * one_grad  # the reference: all gradients, then the adds
    assert temp_bytes(into) < 2 * one_grad
