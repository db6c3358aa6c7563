"""Ring attention: K/V blocks rotate around the context-parallel axis with ``ppermute``.

Each of the ``cp`` steps attends this rank's queries to the K/V block at hand and folds the
result into an online (log-sum-exp) softmax; the next block's ``ppermute`` is issued before
the current block's compute, so XLA can overlap the two. With a causal mask the step
``t > 0`` block comes from rank ``j = (i - t) mod cp``, and only part of it is needed:

* contiguous layout: all of it when ``j < i``, none when ``j > i`` (skipped);
* load-balanced layout (chunks ``i, 2cp-1-i``): when ``j < i`` every query attends to the
  block's first chunk; when ``j > i`` only the second query chunk attends, to all of it.
  Either way a step costs half a block, the same on every rank.

The backward is written out (``jax.custom_vjp``): it keeps only this rank's q, k, v, output
and log-sum-exp, rotates K/V once more, and rotates the dK/dV accumulators with them so
that after ``cp`` steps each rank holds the gradients of its own K/V.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxpg.context_parallel.blocks import block_backward, block_forward, empty_block, merge
from jaxpg.context_parallel.chunks import local_positions

__all__ = ["ring_attention"]


def _rotate(tree, axis: str, n: int):
    perm = [(r, (r + 1) % n) for r in range(n)]
    return jax.tree.map(lambda a: lax.ppermute(a, axis, perm), tree)


def _diag_mask(rank, n: int, seq: int, load_balance: bool) -> jax.Array:
    pos = local_positions(rank, n, seq, load_balance)
    return pos[:, None] >= pos[None, :]


def _pad_rows(x: jax.Array, c: int, fill: float, dim: int) -> jax.Array:
    """``x`` (the second half along ``dim``) with a first half of ``fill`` before it."""
    shape = list(x.shape)
    shape[dim] = c
    return jnp.concatenate([jnp.full(shape, fill, x.dtype), x], axis=dim)


def _forward_step(t, q, k, v, rank, n, scale, causal, load_balance):
    """``(o, lse)`` of the step-``t`` block (from rank ``(rank - t) mod n``)."""
    if not causal:
        return block_forward(q, k, v, scale)
    if t == 0:
        return block_forward(q, k, v, scale, _diag_mask(rank, n, q.shape[1], load_balance))
    source = (rank - t) % n
    c = q.shape[1] // 2
    if load_balance:
        def earlier():
            return block_forward(q, k[:, :c], v[:, :c], scale)

        def later():
            o, lse = block_forward(q[:, c:], k, v, scale)
            return _pad_rows(o, c, 0.0, 1), _pad_rows(lse, c, -jnp.inf, 2)
    else:
        def earlier():
            return block_forward(q, k, v, scale)

        def later():
            return empty_block(q)
    return lax.cond(source < rank, earlier, later)


def _backward_step(t, q, k, v, do, delta, lse, rank, n, scale, causal, load_balance):
    """``(dq, dk, dv)`` of the step-``t`` block."""
    if not causal:
        return block_backward(q, k, v, do, delta, lse, scale)
    if t == 0:
        mask = _diag_mask(rank, n, q.shape[1], load_balance)
        return block_backward(q, k, v, do, delta, lse, scale, mask)
    source = (rank - t) % n
    c = q.shape[1] // 2
    f32 = jnp.float32
    if load_balance:
        def earlier():
            dq, dk, dv = block_backward(q, k[:, :c], v[:, :c], do, delta, lse, scale)
            zeros = jnp.zeros(dk.shape, f32)
            return dq, jnp.concatenate([dk, zeros], 1), jnp.concatenate([dv, zeros], 1)

        def later():
            dq, dk, dv = block_backward(q[:, c:], k, v, do[:, c:], delta[..., c:],
                                        lse[..., c:], scale)
            return _pad_rows(dq, c, 0.0, 1), dk, dv
    else:
        def earlier():
            return block_backward(q, k, v, do, delta, lse, scale)

        def later():
            return (jnp.zeros(q.shape, f32), jnp.zeros(k.shape, f32),
                    jnp.zeros(v.shape, f32))
    return lax.cond(source < rank, earlier, later)


def _ring_forward(q, k, v, axis, n, scale, causal, load_balance):
    rank = lax.axis_index(axis)
    o, lse = empty_block(q)
    kv = (k, v)
    for t in range(n):
        nxt = _rotate(kv, axis, n) if t < n - 1 else None
        o_blk, lse_blk = _forward_step(t, q, *kv, rank, n, scale, causal, load_balance)
        o, lse = merge(o, lse, o_blk, lse_blk)
        kv = nxt
    return o.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, axis: str, n: int,
                   scale: float, causal: bool, load_balance: bool) -> jax.Array:
    """Ring attention of this rank's shards over SPMD axis ``axis`` of size ``n``.

    Args:
        q, k, v: this rank's ``(batch, seq_local, heads, head_dim)`` shards, laid out as
            :mod:`~jaxpg.context_parallel.chunks` describes.
        axis: the context-parallel axis name bound by the running SPMD code.
        n: its size.
        scale: the score scale.
        causal: mask keys at later global positions than the query.
        load_balance: the shards use the ``2 * n``-chunk layout.

    Returns:
        This rank's output shard, in ``q``'s dtype.
    """
    return _ring_forward(q, k, v, axis, n, scale, causal, load_balance)[0]


def _fwd(q, k, v, axis, n, scale, causal, load_balance):
    o, lse = _ring_forward(q, k, v, axis, n, scale, causal, load_balance)
    return o, (q, k, v, o, lse)


def _bwd(axis, n, scale, causal, load_balance, res, do):
    q, k, v, o, lse = res
    rank = lax.axis_index(axis)
    f32 = jnp.float32
    delta = jnp.sum(do.astype(f32) * o.astype(f32), axis=-1).transpose(0, 2, 1)
    dq = jnp.zeros(q.shape, f32)
    dkv = (jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32))
    kv = (k, v)
    for t in range(n):
        nxt = _rotate(kv, axis, n) if t < n - 1 else None
        dq_b, dk_b, dv_b = _backward_step(t, q, *kv, do, delta, lse, rank, n, scale, causal,
                                          load_balance)
        dq = dq + dq_b
        dkv = _rotate((dkv[0] + dk_b, dkv[1] + dv_b), axis, n)
        kv = nxt
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)


ring_attention.defvjp(_fwd, _bwd)
