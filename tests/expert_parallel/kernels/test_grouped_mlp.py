"""``grouped_mlp``, the fused tiled loop and the two separate grouped matmuls, against numpy:
the output and the gradients of the rows and both matrices, with a plain and a gated
activation, for groups that are empty, cross tile boundaries or leave a tail of unused rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_grouped_matmul import CASES

from jaxpg.expert_parallel.grouped_mlp import grouped_mlp


def _gelu(x):
    return jax.nn.gelu(x)


def _swiglu(x):
    half = x.shape[-1] // 2
    return jax.nn.silu(x[..., :half]) * x[..., half:]


def _np_gelu(x):
    """jax.nn.gelu's tanh form and its derivative, in numpy."""
    c = np.sqrt(2 / np.pi)
    t = np.tanh(c * (x + 0.044715 * x ** 3))
    return 0.5 * x * (1 + t), lambda d: d * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c
                                             * (1 + 3 * 0.044715 * x * x))


def _np_swiglu(x):
    half = x.shape[-1] // 2
    g, u = x[..., :half], x[..., half:]
    sig = 1 / (1 + np.exp(-g))
    return g * sig * u, lambda d: np.concatenate(
        [d * u * sig * (1 + g * (1 - sig)), d * g * sig], axis=-1)


# name: (jax's, numpy's with its derivative, width factor)
ACTIVATIONS = {"gelu": (_gelu, _np_gelu, 1), "swiglu": (_swiglu, _np_swiglu, 2)}


def _numpy(activation, rows, w1, w2, sizes, d_out):
    """Output and gradients of ``sum(out · d_out)``, group by group, in float64."""
    rows, w1, w2, d_out = (np.asarray(a, np.float64) for a in (rows, w1, w2, d_out))
    out = np.zeros((rows.shape[0], w2.shape[2]))
    d_rows, d_w1, d_w2 = np.zeros_like(rows), np.zeros_like(w1), np.zeros_like(w2)
    start = 0
    for e, size in enumerate(sizes):
        sl = slice(start, start + size)
        a, vjp = activation(rows[sl] @ w1[e])
        out[sl] = a @ w2[e]
        d_pre = vjp(d_out[sl] @ w2[e].T)
        d_rows[sl] = d_pre @ w1[e].T
        d_w1[e] = rows[sl].T @ d_pre
        d_w2[e] = a.T @ d_out[sl]
        start += size
    return out, d_rows, d_w1, d_w2


@pytest.mark.parametrize("impl", ["tiled", "xla"])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_mlp_equals_numpy(impl, act, case):
    activation, np_activation, widen = ACTIVATIONS[act]
    m, sizes = CASES[case]
    r = np.random.default_rng(0)
    e, d, f = len(sizes), 24, 40
    rows = r.normal(size=(m, d)).astype(np.float32)
    w1 = (r.normal(size=(e, d, widen * f)) / np.sqrt(d)).astype(np.float32)
    w2 = (r.normal(size=(e, f, d)) / np.sqrt(f)).astype(np.float32)
    d_out = r.normal(size=(m, d)).astype(np.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)

    def loss(rows, w1, w2):
        out = grouped_mlp(rows, w1, w2, group_sizes, activation, impl)
        return jnp.sum(out * d_out), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        jnp.asarray(rows), jnp.asarray(w1), jnp.asarray(w2))
    want = _numpy(np_activation, rows, w1, w2, sizes, d_out)
    for name, g, w in zip(("out", "d_rows", "d_w1", "d_w2"), (out, *grads), want):
        assert g.shape == w.shape and g.dtype == jnp.float32, name
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=2e-5, err_msg=name)
    assert not np.any(np.asarray(out)[sum(sizes):]), "the unused tail must come out zero"


def test_the_fused_loop_runs_the_activation_on_tiles_not_on_the_buffer():
    """The tiled MLP's program applies the activation to one tile's rows at a time: no
    tanh (GeLU's) over a buffer-sized array, which the separate matmuls' program has."""
    m, e, d, f = 1024, 4, 16, 32
    args = (jnp.zeros((m, d)), jnp.zeros((e, d, f)), jnp.zeros((e, f, d)),
            jnp.asarray([64, 0, 64, 0], jnp.int32))

    def hlo(impl):
        fn = jax.jit(jax.grad(lambda *a: jnp.sum(grouped_mlp(*a, _gelu, impl)),
                              argnums=(0, 1, 2)))
        return fn.lower(*args).as_text()

    big = f"tensor<{m}x{f}xf32>"
    assert any("tanh" in line and big in line for line in hlo("xla").splitlines())
    assert not any("tanh" in line and big in line for line in hlo("tiled").splitlines())
