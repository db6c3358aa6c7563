"""Context-parallel attention by moving whole tensors: all-gather K/V, or Ulysses' all-to-all.

* :func:`all_gather_attention` (MaxText's default): each rank gathers every rank's K/V and
  attends its own queries to the whole sequence. Simplest; holds the full K/V per rank.
* :func:`all_to_all_attention` (DeepSpeed Ulysses): an all-to-all turns sequence shards into
  head shards (each rank: the whole sequence, ``heads / cp`` heads), attention runs locally,
  and a second all-to-all turns the output back. Needs ``heads`` divisible by ``cp``.
  Grouped-query K/V travel with their own ``kv_heads`` when ``cp`` divides them; otherwise
  each K/V head is repeated the fewest times that make their count divisible by ``cp``
  (at most the query heads), which keeps every query head with its key head.

Both are differentiated by autodiff (the transposes of all-gather and all-to-all are
reduce-scatter and all-to-all). Causal masks come from each token's global position
(:mod:`~jaxpg.context_parallel.chunks`), so both layouts work unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxpg.context_parallel.blocks import dense_attention
from jaxpg.context_parallel.chunks import all_positions, local_positions

__all__ = ["all_gather_attention", "all_to_all_attention", "kv_repeat"]


def kv_repeat(heads: int, kv_heads: int, n: int) -> int:
    """The fewest repeats ``f`` of each K/V head (``f`` dividing ``heads // kv_heads``) that
    make ``kv_heads * f`` divisible by ``n``, the all-to-all's split (1: none needed)."""
    group = heads // kv_heads
    for f in range(1, group + 1):
        if group % f == 0 and (kv_heads * f) % n == 0:
            return f
    return group


def all_gather_attention(q: jax.Array, k: jax.Array, v: jax.Array, axis: str, n: int,
                         scale: float, causal: bool, load_balance: bool) -> jax.Array:
    """Attention of this rank's queries to the all-gathered K/V (arguments as ring's)."""
    k_all = lax.all_gather(k, axis, axis=1, tiled=True)
    v_all = lax.all_gather(v, axis, axis=1, tiled=True)
    mask = None
    if causal:
        q_pos = local_positions(lax.axis_index(axis), n, q.shape[1], load_balance)
        k_pos = jnp.asarray(all_positions(n, k.shape[1], load_balance))
        mask = q_pos[:, None] >= k_pos[None, :]
    return dense_attention(q, k_all, v_all, scale, mask)


def all_to_all_attention(q: jax.Array, k: jax.Array, v: jax.Array, axis: str, n: int,
                         scale: float, causal: bool, load_balance: bool) -> jax.Array:
    """Ulysses attention: sequence shards to head shards and back (arguments as ring's)."""
    def to_heads(x):
        return lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)

    mask = None
    if causal:
        pos = jnp.asarray(all_positions(n, q.shape[1], load_balance))
        mask = pos[:, None] >= pos[None, :]
    repeat = kv_repeat(q.shape[2], k.shape[2], n)
    if repeat > 1:
        k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
    o = dense_attention(to_heads(q), to_heads(k), to_heads(v), scale, mask)
    return lax.all_to_all(o, axis, split_axis=1, concat_axis=2, tiled=True)
