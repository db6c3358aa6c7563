"""Host helpers that lay a sequence out over the context-parallel group and back.

:func:`shard_sequence` cuts a full sequence into the shards :func:`~jaxpg.context_parallel.
attention` expects (contiguous, or the load-balanced ``2 * cp``-chunk layout) and returns,
with them, each shard's global position ids (for rotary or learned position embeddings) and
a :class:`SequenceLayout` record. :func:`unshard_sequence` undoes it; given that record it
refuses a different ``load_balance`` instead of silently scrambling the sequence.

Local data is as everywhere in jaxpg: with every rank of the group in this process, the
shards stacked along a new leading axis in group-rank order; across processes with one rank
each, this process's shard.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxpg.context_parallel.chunks import chunk_order, local_positions
from jaxpg.groups import world as _world
from jaxpg.groups.mesh_axis import resolve_mesh_axis

__all__ = ["SequenceLayout", "SequenceShards", "shard_sequence", "unshard_sequence"]


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    """How :func:`shard_sequence` split a sequence.

    Attributes:
        cp: the context-parallel degree.
        load_balance: whether the ``2 * cp``-chunk layout was used.
        seq_len: the full sequence length.
        seq_dim: the sequence dimension of the (unstacked) data.
        local_ranks: the group ranks whose shards this process holds, in order.
        stacked: whether the shards carry a leading stacked rank axis.
    """

    cp: int
    load_balance: bool
    seq_len: int
    seq_dim: int
    local_ranks: tuple[int, ...]
    stacked: bool


class SequenceShards(NamedTuple):
    """What :func:`shard_sequence` returns: ``x, position_ids, layout = shard_sequence(...)``.

    Attributes:
        x: this process's shards.
        position_ids: their global positions (int32), ``(seq_local,)`` per rank, stacked as
            ``x`` is.
        layout: the :class:`SequenceLayout`, for :func:`unshard_sequence`.
    """

    x: Any
    position_ids: Any
    layout: SequenceLayout


def _local_layout(group: Any, api: str) -> tuple[Any, tuple[int, ...], bool]:
    cp = resolve_mesh_axis(group, "cp", api=api)
    if cp.group is None:
        raise TypeError(f"{api}: pass group= as a ProcessGroup or mesh['cp'].")
    state = _world.current()
    local = set(state.local_ranks)
    ranks = tuple(i for i, r in enumerate(cp.group.ranks) if r in local)
    stacked = not (state.multiprocess and len(ranks) == 1)
    return cp, ranks, stacked


def _check_dim(seq_dim: int, ndim: int, api: str) -> int:
    if not -ndim <= seq_dim < ndim:
        raise ValueError(f"{api}: seq_dim={seq_dim} is out of range for {ndim}-d data.")
    return seq_dim % ndim


def shard_sequence(x: Any, group: Any = None, *, seq_dim: int = 1,
                   load_balance: bool = False) -> SequenceShards:
    """Splits the full sequence ``x`` (the same on every process) into this process's shards.

    Args:
        x: the whole sequence, e.g. ``(batch, seq, ...)`` tokens or activations.
        group: the context-parallel group (ProcessGroup, ``mesh["cp"]``, None: the world).
        seq_dim: the sequence dimension of ``x``.
        load_balance: use the ``2 * cp``-chunk layout (rank ``i``: chunks ``i`` and
            ``2 * cp - 1 - i``), for causal attention.

    Returns:
        ``SequenceShards(x, position_ids, layout)``.

    Raises:
        ValueError: if the sequence length is not divisible by ``cp`` (``2 * cp`` with
            ``load_balance``), or ``seq_dim`` is out of range.
    """
    api = "shard_sequence"
    cp, ranks, stacked = _local_layout(group, api)
    x = np.asarray(x)  # layout work on the host: no device kernel per slice
    dim = _check_dim(seq_dim, x.ndim, api)
    seq = x.shape[dim]
    parts = 2 * cp.size if load_balance else cp.size
    if seq % parts:
        raise ValueError(
            f"{api}: the sequence length {seq} (dim {dim} of shape {tuple(x.shape)}) is not "
            f"divisible by {'2 * cp' if load_balance else 'cp'} = {parts}; pad it to a "
            f"multiple of {parts}" + (" or pass load_balance=False." if load_balance else "."))
    chunks = np.split(x, parts, axis=dim)
    order = chunk_order(cp.size, load_balance)
    per = len(order) // cp.size
    seq_local = seq // cp.size

    def shard(r: int):
        return np.concatenate([chunks[c] for c in order[r * per:(r + 1) * per]], axis=dim)

    def pos(r: int):
        return local_positions(r, cp.size, seq_local, load_balance).astype(np.int32)

    layout = SequenceLayout(cp.size, bool(load_balance), seq, dim, ranks, stacked)
    if not stacked:
        return SequenceShards(jnp.asarray(shard(ranks[0])), jnp.asarray(pos(ranks[0])), layout)
    return SequenceShards(jnp.asarray(np.stack([shard(r) for r in ranks])),
                          jnp.asarray(np.stack([pos(r) for r in ranks])), layout)


def unshard_sequence(y: Any, group: Any = None, *, seq_dim: int = 1,
                     load_balance: bool | None = None,
                     layout: SequenceLayout | None = None) -> Any:
    """Gathers every rank's shard of ``y`` and returns the full sequence, in order.

    Args:
        y: this process's shards (as :func:`shard_sequence` lays them out), or a
            :class:`SequenceShards` (its layout is then used).
        group: the context-parallel group.
        seq_dim: the sequence dimension of the (unstacked) shards.
        load_balance: the layout of ``y``; None: ``layout``'s, or False without one.
        layout: :func:`shard_sequence`'s record of the layout, checked against
            ``load_balance`` and the group.

    Raises:
        ValueError: if ``load_balance`` or the group differ from ``layout``'s, or the shards
            do not fit the group.
    """
    api = "unshard_sequence"
    if isinstance(y, SequenceShards):
        layout = y.layout if layout is None else layout
        y = y.x
    cp, ranks, stacked = _local_layout(group, api)
    if layout is not None:
        if load_balance is not None and bool(load_balance) != layout.load_balance:
            raise ValueError(
                f"{api}: load_balance={load_balance} but the shards were made by "
                f"shard_sequence(..., load_balance={layout.load_balance}); pass "
                f"load_balance={layout.load_balance} (or leave it None with layout=).")
        if layout.cp != cp.size:
            raise ValueError(f"{api}: the shards were made for cp={layout.cp}, but the group "
                             f"has {cp.size} ranks; pass the same group as to shard_sequence.")
        load_balance = layout.load_balance
    load_balance = bool(load_balance)
    if not stacked:
        from jaxpg.collectives.gathers import all_gather_into_tensor

        y = all_gather_into_tensor(jnp.asarray(y)[None], group=cp.group)
    elif len(ranks) != cp.size:
        raise ValueError(f"{api}: this process holds {len(ranks)} of the group's {cp.size} "
                         "ranks; across processes run one rank per process.")
    y = np.asarray(y)
    if y.shape[0] != cp.size:
        raise ValueError(f"{api}: expected {cp.size} stacked shards (one per rank); got "
                         f"leading axis {y.shape[0]} of shape {tuple(y.shape)}.")
    dim = _check_dim(seq_dim, y.ndim - 1, api) + 1
    order = chunk_order(cp.size, load_balance)
    per = len(order) // cp.size
    if y.shape[dim] % per:
        raise ValueError(f"{api}: load_balance=True needs an even seq_local; got "
                         f"{y.shape[dim]}.")
    pieces = [p for r in range(cp.size) for p in np.split(y[r], per, axis=dim - 1)]
    natural = [pieces[order.index(c)] for c in range(len(order))]
    return jnp.asarray(np.concatenate(natural, axis=dim - 1))
