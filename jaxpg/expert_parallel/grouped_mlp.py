"""The experts' MLP on rows grouped by expert: ``activation(rows @ w1[e]) @ w2[e]``.

With the ``"tiled"`` grouped matmul the whole MLP runs in one loop over the tiles that hold
routed rows (:mod:`.grouped_matmul`'s work items): each step multiplies a tile by its
expert's first matrix, applies the activation and multiplies by the second. The activation
and its gradient then run on the rows the experts got, not on every row of the worst-case
buffer, which is most of the buffer once ``ep > 1`` (``ep · tokens · min(top_k, E / ep)``
rows for ``tokens · top_k`` routed ones). The pre-activations are kept for the backward,
tile by tile, as the two separate matmuls keep their hidden layer.

The other implementations (``"xla"``, ``"mosaic"``) compute every row anyway: there the MLP
is the two grouped matmuls with the activation between them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxpg.expert_parallel.grouped_matmul import (
    TILE_ROWS,
    grouped_matmul,
    pad_rows,
    resolve_grouped_matmul,
    round_up,
    tile_loop,
)

__all__ = ["grouped_mlp", "separate_mlp"]

Activation = Callable[[jax.Array], jax.Array]


def grouped_mlp(rows: jax.Array, w1: jax.Array, w2: jax.Array, group_sizes: jax.Array,
                activation: Activation, impl: str = "auto") -> jax.Array:
    """``activation(rows @ w1[e]) @ w2[e]`` for the rows of each group ``e``.

    Args:
        rows: ``(m, d)`` rows in group order; rows past ``sum(group_sizes)`` come out zero.
        w1: ``(E, d, h)`` the groups' first matrices.
        w2: ``(E, f, d_out)`` their second ones; ``activation`` maps width ``h`` to ``f``
            (a gated activation halves it).
        group_sizes: ``(E,)`` int32 rows per group.
        activation: an elementwise (or gated) function of the hidden rows.
        impl: the grouped matmul (:func:`.grouped_matmul.grouped_matmul`); ``"tiled"``
            (CPU's default) runs the fused loop of the module docstring.

    Returns:
        ``(m, d_out)``.
    """
    if resolve_grouped_matmul(impl, rows, w1) == "tiled":
        return _fused(activation, rows, w1, w2, group_sizes.astype(jnp.int32))
    return separate_mlp(rows, w1, w2, group_sizes, activation, impl)


def separate_mlp(rows: jax.Array, w1: jax.Array, w2: jax.Array, group_sizes: jax.Array,
                 activation: Activation, impl: str = "auto") -> jax.Array:
    """The same MLP as two grouped matmuls, the activation over every row between them
    (what the non-tiled implementations run; ``bench/grouped_mlp.py`` times it beside the
    fused loop)."""
    hidden = grouped_matmul(rows, w1, group_sizes, impl=impl)
    return grouped_matmul(activation(hidden), w2, group_sizes, impl=impl)


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                           preferred_element_type=jnp.float32)


def _index(w: jax.Array, e: jax.Array) -> jax.Array:
    return lax.dynamic_index_in_dim(w, e, keepdims=False)


def _add_at(acc: jax.Array, e: jax.Array, part: jax.Array) -> jax.Array:
    return lax.dynamic_update_index_in_dim(acc, _index(acc, e) + part, e, 0)


def _forward(activation: Activation, rows: jax.Array, w1: jax.Array, w2: jax.Array,
             group_sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The output ``(m, d_out)`` and the pre-activations, ``(padded m, h)``."""
    m = rows.shape[0]
    padded = round_up(m, TILE_ROWS)
    rows_p = pad_rows(rows, padded)
    hidden_dtype = jnp.result_type(rows.dtype, w1.dtype)
    out_dtype = jnp.result_type(hidden_dtype, w2.dtype)

    def body(e, row0, mask, carry):
        out, pre = carry
        tile = lax.dynamic_slice_in_dim(rows_p, row0, TILE_ROWS)
        p = _dot(tile, _index(w1, e), (1, 0)).astype(hidden_dtype)
        y = _dot(activation(p), _index(w2, e), (1, 0)).astype(out_dtype)
        cur_pre = lax.dynamic_slice_in_dim(pre, row0, TILE_ROWS)
        pre = lax.dynamic_update_slice_in_dim(pre, jnp.where(mask, p, cur_pre), row0, 0)
        cur = lax.dynamic_slice_in_dim(out, row0, TILE_ROWS)
        out = lax.dynamic_update_slice_in_dim(out, cur + jnp.where(mask, y, 0), row0, 0)
        return out, pre

    init = (jnp.zeros((padded, w2.shape[2]), out_dtype),
            jnp.zeros((padded, w1.shape[2]), hidden_dtype))
    out, pre = tile_loop(body, init, group_sizes, m)
    return out[:m], pre


def _backward(activation: Activation, rows: jax.Array, w1: jax.Array, w2: jax.Array,
              group_sizes: jax.Array, pre: jax.Array, d_out: jax.Array):
    """Gradients of the rows and of both matrices, tile by tile."""
    m = rows.shape[0]
    padded = pre.shape[0]
    rows_p, d_out_p = pad_rows(rows, padded), pad_rows(d_out, padded)

    def body(e, row0, mask, carry):
        d_rows, d_w1, d_w2 = carry
        # only the group's rows get a cotangent, so every product below is zero elsewhere
        tile = lax.dynamic_slice_in_dim(rows_p, row0, TILE_ROWS)
        d_y = jnp.where(mask, lax.dynamic_slice_in_dim(d_out_p, row0, TILE_ROWS), 0)
        a, act_vjp = jax.vjp(activation, lax.dynamic_slice_in_dim(pre, row0, TILE_ROWS))
        d_a = _dot(d_y, _index(w2, e), (1, 1)).astype(a.dtype)
        (d_p,) = act_vjp(d_a)
        d_tile = _dot(d_p, _index(w1, e), (1, 1)).astype(rows.dtype)
        cur = lax.dynamic_slice_in_dim(d_rows, row0, TILE_ROWS)
        d_rows = lax.dynamic_update_slice_in_dim(d_rows, cur + jnp.where(mask, d_tile, 0),
                                                 row0, 0)
        d_w1 = _add_at(d_w1, e, _dot(tile, d_p, (0, 0)))
        d_w2 = _add_at(d_w2, e, _dot(a, d_y, (0, 0)))
        return d_rows, d_w1, d_w2

    init = (jnp.zeros((padded, rows.shape[1]), rows.dtype),
            jnp.zeros(w1.shape, jnp.float32), jnp.zeros(w2.shape, jnp.float32))
    d_rows, d_w1, d_w2 = tile_loop(body, init, group_sizes, m)
    return d_rows[:m], d_w1.astype(w1.dtype), d_w2.astype(w2.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(activation: Activation, rows: jax.Array, w1: jax.Array, w2: jax.Array,
           group_sizes: jax.Array) -> jax.Array:
    """The fused tiled MLP, differentiable in the rows and both matrices."""
    return _forward(activation, rows, w1, w2, group_sizes)[0]


def _fused_fwd(activation: Activation, rows, w1, w2, group_sizes):
    out, pre = _forward(activation, rows, w1, w2, group_sizes)
    return out, (rows, w1, w2, group_sizes, pre)


def _fused_bwd(activation: Activation, res: Any, d_out: jax.Array):
    rows, w1, w2, group_sizes, pre = res
    d_rows, d_w1, d_w2 = _backward(activation, rows, w1, w2, group_sizes, pre,
                                   d_out.astype(rows.dtype))
    return d_rows, d_w1, d_w2, None


_fused.defvjp(_fused_fwd, _fused_bwd)
