"""Softmax attention on one block of queries and keys, with its log-sum-exp.

The ring combines blocks with an online (log-sum-exp) softmax: each block gives its output
normalised within the block and the log-sum-exp of its scores, and :func:`merge` folds it
into the running pair. :func:`block_backward` is the matching backward of one block given
the *final* log-sum-exp (FlashAttention's recurrence), so the ring's VJP needs no more than
the block at hand. Arrays are ``(batch, seq, heads, head_dim)``; log-sum-exps are
``(batch, heads, seq)``; everything is computed in float32.

Grouped-query attention is taken as it is: ``k`` and ``v`` may have fewer heads than ``q``
(``kv_heads`` dividing ``heads``), query head ``h`` attending to key head
``h // (heads // kv_heads)``; the blocks compute over ``(batch, kv_heads, group, seq, d)``,
so K/V are never repeated and their gradients come back with ``kv_heads`` heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["block_forward", "block_backward", "merge", "empty_block", "dense_attention"]

F32 = jnp.float32


def _heads_major(x: jax.Array) -> jax.Array:
    """``(batch, seq, heads, d)`` as ``(batch, heads, seq, d)``, in float32."""
    return x.astype(F32).transpose(0, 2, 1, 3)


def _grouped(q: jax.Array, kv_heads: int) -> jax.Array:
    """``q`` ``(batch, seq, heads, d)`` as ``(batch, kv_heads, group, seq, d)``, float32."""
    b, s, h, d = q.shape
    return q.astype(F32).reshape(b, s, kv_heads, h // kv_heads, d).transpose(0, 2, 3, 1, 4)


def _ungrouped(x: jax.Array) -> jax.Array:
    """``(batch, kv_heads, group, seq, d)`` back to ``(batch, seq, heads, d)``."""
    b, g, r, s, d = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, s, g * r, d)


def _seq_major(x: jax.Array) -> jax.Array:
    return x.transpose(0, 2, 1, 3)


def _scores(qg: jax.Array, kh: jax.Array, scale: float) -> jax.Array:
    s = jnp.einsum("bgrqd,bgkd->bgrqk", qg, kh, preferred_element_type=F32)
    return s * jnp.asarray(scale, F32)


def _grouped_lse(lse: jax.Array, kv_heads: int) -> jax.Array:
    """``(batch, heads, seq)`` as ``(batch, kv_heads, group, seq)``."""
    b, h, s = lse.shape
    return lse.reshape(b, kv_heads, h // kv_heads, s)


# The matmuls run heads-major, (batch, heads, seq, d): written over (batch, seq, heads, d)
# operands, XLA:CPU computed the probabilities-times-values product transposed, and a block
# took much longer (docs/context_parallel.md has the figures). The transposes cost O(seq * d).


def block_forward(q: jax.Array, k: jax.Array, v: jax.Array, scale: float,
                  mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Returns ``(o, lse)``: the block's softmax output (float32) and log-sum-exp.

    Args:
        mask: ``(q_len, k_len)`` booleans, True where a query may attend to a key; a row
            with no True gets output 0 and log-sum-exp ``-inf``.
    """
    kv_heads = k.shape[2]
    s = _scores(_grouped(q, kv_heads), _heads_major(k), scale)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    total = jnp.sum(p, axis=-1, keepdims=True)
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    # normalised after the product: a (q, d) division, not a (q, k) one
    o = jnp.einsum("bgrqk,bgkd->bgrqd", p, _heads_major(v)) / safe
    lse = jnp.where(seen, m + jnp.log(safe), -jnp.inf)[..., 0]
    b, g, r, t = lse.shape
    return _ungrouped(o), lse.reshape(b, g * r, t)


def empty_block(q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The ``(o, lse)`` of a block that every query skips."""
    b, s, h, d = q.shape
    return jnp.zeros((b, s, h, d), F32), jnp.full((b, h, s), -jnp.inf, F32)


def merge(o: jax.Array, lse: jax.Array, o_blk: jax.Array,
          lse_blk: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Folds one block's ``(o_blk, lse_blk)`` into the running ``(o, lse)``."""
    new = jnp.logaddexp(lse, lse_blk)
    ref = jnp.where(jnp.isfinite(new), new, 0.0)
    a = jnp.exp(lse - ref).transpose(0, 2, 1)[..., None]
    b = jnp.exp(lse_blk - ref).transpose(0, 2, 1)[..., None]
    return o * a + o_blk * b, new


def block_backward(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, delta: jax.Array,
                   lse: jax.Array, scale: float, mask: jax.Array | None = None
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns one block's ``(dq, dk, dv)`` (float32); ``dk, dv`` have ``k``'s heads.

    Args:
        do: the output's cotangent, ``(batch, q_len, heads, head_dim)``.
        delta: ``sum(do * o, -1)`` of the final output, ``(batch, heads, q_len)``.
        lse: the final log-sum-exp of the queries, ``(batch, heads, q_len)``.
    """
    g = k.shape[2]
    qg, kh, vh, dog = _grouped(q, g), _heads_major(k), _heads_major(v), _grouped(do, g)
    p = jnp.exp(_scores(qg, kh, scale) - _grouped_lse(lse, g)[..., None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    dv = jnp.einsum("bgrqk,bgrqd->bgkd", p, dog)
    dp = jnp.einsum("bgrqd,bgkd->bgrqk", dog, vh)
    ds = p * (dp - _grouped_lse(delta, g)[..., None]) * jnp.asarray(scale, F32)
    dq = jnp.einsum("bgrqk,bgkd->bgrqd", ds, kh)
    dk = jnp.einsum("bgrqk,bgrqd->bgkd", ds, qg)
    return _ungrouped(dq), _seq_major(dk), _seq_major(dv)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float,
                    mask: jax.Array | None = None) -> jax.Array:
    """Plain softmax attention (differentiated by autodiff), in ``q``'s dtype."""
    o, _ = block_forward(q, k, v, scale, mask)
    return o.astype(q.dtype)
