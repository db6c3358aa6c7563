"""Token dispatch and combine over the expert-parallel group (one rank's view, SPMD code).

The plan follows torch's pattern: every rank learns how many tokens each rank sends to
each expert first (a small ``all_gather`` of per-expert counts, from which the per-pair
counts of the ``all_to_all`` follow), then the tokens go by ``all_to_all_single``, the
experts run on exactly the tokens they got, and the results return by the inverse
``all_to_all_single``.

Shapes inside ``jit`` are static, so the exchanged buffers have a static worst-case size:
``S`` rows per pair of ranks, ``S = tokens · min(top_k, E_local)`` when dropless (every
token of a rank may pick experts of one other rank) and at most ``E_local · capacity`` with
a capacity. The counts are exact; the rows past them are zeros that the grouped matmul
(:mod:`jaxpg.expert_parallel.grouped_matmul`) never multiplies. A step first tries smaller
buffers, a factor times the balanced load (:func:`first_try_rows`); the gathered counts
tell every rank alike whether the routing fits them (:func:`kept_pair_max`), and when it
does not the whole exchange runs at the worst-case size instead. See docs/expert_parallel.md
for why.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxpg.collectives.all_to_all import all_to_all_single
from jaxpg.collectives.gathers import all_gather_into_tensor
from jaxpg.expert_parallel.grouped_mlp import grouped_mlp

__all__ = ["slot_counts", "keep_mask", "kept_counts", "received_counts", "kept_pair_max",
           "first_try_rows", "dispatch_rows", "received_rows", "dispatch", "combine",
           "exchange", "expert_ffn"]


def _exclusive_cumsum(a: jax.Array, axis: int) -> jax.Array:
    return jnp.cumsum(a, axis=axis) - a


def slot_counts(experts: jax.Array, num_experts: int, group: Any) -> jax.Array:
    """Every rank's count of tokens per (choice slot, expert): ``(ep, top_k, E)`` int32."""
    local = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.int32), axis=0)  # (k, E)
    if group is None:  # one rank, no SPMD code: nothing to exchange
        return local[None]
    gathered = all_gather_into_tensor(local, group=group)
    return gathered.reshape((-1, *local.shape))


def keep_mask(experts: jax.Array, counts: jax.Array, rank: Any,
              capacity: int | None) -> jax.Array:
    """Which of this rank's choices an expert takes: ``(tokens, top_k)`` bool.

    An expert takes its first ``capacity`` choices in the global order: all first choices
    before any second choice (GShard), then by rank, then by token. None takes them all.
    """
    if capacity is None:
        return jnp.ones(experts.shape, bool)
    num_experts = counts.shape[-1]
    onehot = jax.nn.one_hot(experts, num_experts, dtype=jnp.int32)  # (T, k, E)
    within = jnp.cumsum(onehot, axis=0) - onehot  # earlier tokens of this rank, same slot
    slots_before = _exclusive_cumsum(jnp.sum(counts, axis=0), axis=0)  # (k, E)
    ranks_before = jnp.take(_exclusive_cumsum(counts, axis=0), rank, axis=0)  # (k, E)
    position = jnp.sum(onehot * (within + slots_before + ranks_before), axis=-1)
    return position < capacity


def kept_counts(counts: jax.Array, capacity: int | None) -> jax.Array:
    """Every rank's kept choices per expert: ``(ep, E)`` int32, from the gathered
    ``(ep, top_k, E)`` counts (the same on every rank).

    With a capacity, the choices an expert keeps follow :func:`keep_mask`'s order: slot,
    then rank, then token. Row ``r`` is what rank ``r`` sends each expert, so the counts a
    rank receives follow from it without exchanging them.
    """
    kept = counts
    if capacity is not None:
        slots_before = _exclusive_cumsum(jnp.sum(counts, axis=0), axis=0)  # (k, E)
        start = slots_before[None] + _exclusive_cumsum(counts, axis=0)  # (ep, k, E)
        kept = jnp.clip(capacity - start, 0, counts)
    return jnp.sum(kept, axis=1)


def received_counts(kept: jax.Array, rank: Any) -> jax.Array:
    """``(ep, E_local)``: the rows this rank receives from each source for each of its
    experts, read from :func:`kept_counts` (``rank`` may be traced)."""
    ep, num_experts = kept.shape
    local = num_experts // ep
    return jax.lax.dynamic_slice_in_dim(kept, rank * local, local, axis=1)


def kept_pair_max(counts: jax.Array, capacity: int | None) -> jax.Array:
    """The most kept choices any rank sends to any rank (int32 scalar, the same on every
    rank: it is computed from the gathered ``(ep, top_k, E)`` counts)."""
    ep, _, num_experts = counts.shape
    per_pair = kept_counts(counts, capacity).reshape(ep, ep, num_experts // ep).sum(axis=-1)
    return jnp.max(per_pair)


def first_try_rows(tokens: int, top_k: int, ep: int, worst: int,
                   buffer_factor: float | None) -> int | None:
    """The first-try buffer's rows per pair of ranks, ``ceil(buffer_factor · tokens ·
    top_k / ep)`` (the balanced load times the factor); None where it would not be smaller
    than the worst case ``worst`` (or ``buffer_factor`` is None, or there is one rank)."""
    if buffer_factor is None or ep == 1:
        return None
    rows = math.ceil(buffer_factor * tokens * top_k / ep)
    return rows if rows < worst else None


def dispatch_rows(experts: jax.Array, keep: jax.Array, num_experts: int, ep: int,
                  rows_per_rank: int) -> tuple[jax.Array, jax.Array]:
    """Where each kept choice goes in the send buffer, grouped by destination, then expert.

    Returns:
        ``(row, sent)``: ``row`` ``(tokens · top_k,)`` the row of the ``(ep · S, d)`` send
        buffer of each choice (``ep · S``, out of range, for a dropped one), and ``sent``
        ``(E,)`` the kept choices per expert.
    """
    key = jnp.where(keep.reshape(-1), experts.reshape(-1), num_experts)
    order = jnp.argsort(key, stable=True)
    sent = jnp.zeros((num_experts + 1,), jnp.int32).at[key].add(1)[:num_experts]
    rank_start = _exclusive_cumsum(sent.reshape(ep, -1).sum(axis=1), axis=0)
    sorted_key = key[order]
    dest = jnp.minimum(sorted_key // (num_experts // ep), ep - 1)
    offset = jnp.arange(key.shape[0], dtype=jnp.int32) - jnp.take(rank_start, dest)
    row_sorted = jnp.where(sorted_key < num_experts, dest * rows_per_rank + offset,
                           ep * rows_per_rank)
    row = jnp.zeros_like(row_sorted).at[order].set(row_sorted)
    return row, sent


def received_rows(received_counts: jax.Array, rows_per_rank: int) -> tuple[jax.Array, jax.Array]:
    """For each received row (source-major), its row in the expert-major buffer.

    ``received_counts[s, e]``: rows from source ``s`` for local expert ``e`` (in that order
    within the source's block). Returns ``(row, group_sizes)``; an empty row maps out of
    range (``ep · S``).
    """
    ep, local_experts = received_counts.shape
    within_source = jnp.cumsum(received_counts, axis=1)  # (ep, E_local) inclusive
    i = jnp.arange(rows_per_rank, dtype=jnp.int32)[None, :, None]  # (1, S, 1)
    expert = jnp.sum(i >= within_source[:, None, :], axis=-1)  # (ep, S) local expert of row
    valid = expert < local_experts
    expert_c = jnp.minimum(expert, local_experts - 1)
    first = jnp.take_along_axis(within_source - received_counts, expert_c, axis=1)
    group_sizes = jnp.sum(received_counts, axis=0)
    expert_start = _exclusive_cumsum(group_sizes, axis=0)
    sources_before = _exclusive_cumsum(received_counts, axis=0)  # (ep, E_local)
    row = (jnp.take(expert_start, expert_c)
           + jnp.take_along_axis(sources_before, expert_c, axis=1)
           + i[..., 0] - first)
    return jnp.where(valid, row, ep * rows_per_rank).reshape(-1), group_sizes


def _all_to_all(x: jax.Array, group: Any) -> jax.Array:
    """``all_to_all_single`` with even splits; the identity for one rank (``group`` None)."""
    return x if group is None else all_to_all_single(x, group=group)


def expert_ffn(rows: jax.Array, w1: jax.Array, w2: jax.Array, group_sizes: jax.Array,
               activation: Callable[[jax.Array], jax.Array], impl: str = "auto") -> jax.Array:
    """``activation(rows @ w1[e]) @ w2[e]`` for the rows of each local expert ``e``, grouped
    in expert order (``group_sizes`` rows each; the rows after them come out zero).
    ``impl`` names the grouped matmul (:func:`.grouped_matmul.grouped_matmul`); with the
    tiled one the MLP is one loop over the routed rows (:mod:`.grouped_mlp`)."""
    return grouped_mlp(rows, w1, w2, group_sizes, activation, impl)


def dispatch(x_rows: jax.Array, row: jax.Array, grouped_row: jax.Array, group: Any,
             ep: int, rows_per_rank: int, grouped_size: int) -> jax.Array:
    """Sends each choice's token to its expert's rank and regroups what arrived expert by
    expert: ``(grouped_size, d)``, the rows after the received ones zero. Linear in
    ``x_rows``; the indices come from :func:`dispatch_rows` and :func:`_received_rows` at
    ``rows_per_rank``."""
    size = ep * rows_per_rank
    send = jnp.zeros((size, x_rows.shape[1]), x_rows.dtype).at[row].set(x_rows, mode="drop")
    received = _all_to_all(send, group)
    return jnp.zeros((grouped_size, x_rows.shape[1]), x_rows.dtype).at[grouped_row].set(
        received, mode="drop")


def combine(out: jax.Array, row: jax.Array, grouped_row: jax.Array, group: Any, ep: int,
            rows_per_rank: int) -> jax.Array:
    """The inverse of :func:`dispatch` for the experts' output ``out`` (expert-major): each
    choice's result, ``(tokens · top_k, d)``, zero for a dropped choice."""
    size = ep * rows_per_rank
    valid = (grouped_row < out.shape[0])[:, None]
    back = jnp.where(valid, jnp.take(out, jnp.minimum(grouped_row, out.shape[0] - 1), axis=0),
                     0)
    returned = _all_to_all(back, group)
    kept = (row < size)[:, None]
    return jnp.where(kept, jnp.take(returned, jnp.minimum(row, size - 1), axis=0), 0)


def exchange(x_rows: jax.Array, row: jax.Array, from_source: jax.Array, w1: jax.Array,
             w2: jax.Array, activation: Callable[[jax.Array], jax.Array], group: Any, ep: int,
             rows_per_rank: int, impl: str = "auto") -> jax.Array:
    """Sends each choice's token to its expert's rank, runs the experts, and brings the
    results back: ``(tokens · top_k, d)``, zero for a dropped choice.

    Args:
        x_rows: ``(tokens · top_k, d)`` the token of each choice.
        row: from :func:`dispatch_rows`.
        from_source: ``(ep, E_local)`` the rows this rank receives from each source for each
            of its experts (:func:`received_counts`; known from the gathered counts, so no
            exchange of counts runs here).
        w1, w2: this rank's experts.
        group: the expert-parallel ProcessGroup (None: one rank, no SPMD code).
        ep: its size.
        rows_per_rank: ``S``.
        impl: the grouped matmul's implementation.
    """
    size = ep * rows_per_rank
    grouped_row, group_sizes = received_rows(from_source, rows_per_rank)
    grouped = dispatch(x_rows, row, grouped_row, group, ep, rows_per_rank, size)
    out = expert_ffn(grouped, w1, w2, group_sizes, activation, impl)
    return combine(out, row, grouped_row, group, ep, rows_per_rank)
