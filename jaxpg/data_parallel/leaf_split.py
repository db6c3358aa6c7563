"""How one array is split on dim 0 over the ranks of a sharding group (ZeRO and FSDP).

A :class:`LeafSplit` is data, made once from a leaf's shape: the leaf is stored as a
global ``jax.Array`` whose dim 0 is padded with zeros up to a multiple of the shard count
``n`` and split in ``n`` equal blocks, rank ``i`` holding rows
``[i * b, (i + 1) * b)`` with ``b = padded_dim0 / n``. This is FSDP2's per-parameter
dim-0 sharding; JAX arrays cannot be split unevenly, so where torch's last ranks hold
shorter shards, here they hold zero rows. A dim 0 that already divides by ``n`` (most
transformer weights) gets no padding at all. Zero-dimensional leaves (scalars) stay
replicated.

A leaf that is already split on dim 0 over other mesh axes (tensor parallelism: a
row-parallel kernel ``P("tp", None)``) is described by ``dim0_blocks`` (the number of
those blocks) and ``base_spec``: each block is padded on its own, and the sharding
axes are appended to dim 0's entry of the spec (``P(("tp", "dp"), None)``), so gathering
over the sharding axes inside ``shard_map`` gives back the block the tensor-parallel code
expects. ``dim`` picks another dimension to split (a pipeline's stage stack ``[S, ...]``,
already split over ``pp`` on dim 0, is split over ``dp`` on dim 1); "dim 0" below means
that dimension.

Example:
    >>> layout = LeafSplit.of((10, 3), "float32", num_shards=4)
    >>> layout.padded_shape, layout.shard_shape
    ((12, 3), (3, 3))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

__all__ = ["LeafSplit", "make_leaf_splits", "pad_leaf", "unpad_leaf", "leaf_split_bytes",
           "spec_axes"]


def _spec_entries(spec: P, ndim: int) -> list[Any]:
    entries = list(spec) + [None] * (ndim - len(spec))
    if len(entries) > ndim:
        raise ValueError(f"{spec=} has more entries than the array's {ndim} dimensions.")
    return entries


def spec_axes(spec: P) -> set[Hashable]:
    """The mesh axes a ``PartitionSpec`` names, in any of its entries."""
    return {a for entry in spec for a in _as_tuple(entry)}


def _as_tuple(entry: Any) -> tuple[Hashable, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple | list) else (entry,)


@dataclasses.dataclass(frozen=True)
class LeafSplit:
    """The dim-0 sharding of one leaf over ``num_shards`` ranks.

    Attributes:
        shape: the leaf's true (unpadded) global shape.
        dtype: the leaf's dtype.
        num_shards: ``n``, the number of ranks sharing the leaf.
        dim0_blocks: the number of blocks dim 0 is already split into over other mesh
            axes (1 unless the leaf is tensor-parallel on dim 0); each is padded alone.
        base_spec: the leaf's sharding over other mesh axes (``P()`` for a plain leaf).
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    num_shards: int
    dim0_blocks: int = 1
    base_spec: P = P()
    dim: int = 0

    @classmethod
    def of(cls, shape: Any, dtype: Any, num_shards: int, *, dim0_blocks: int = 1,
           base_spec: P | None = None, dim: int = 0) -> LeafSplit:
        """The layout of a leaf of ``shape`` and ``dtype`` over ``num_shards`` ranks."""
        base_spec = P() if base_spec is None else base_spec
        if not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"LeafSplit: {num_shards=} must be an int >= 1.")
        shape = tuple(int(d) for d in shape)
        if len(shape) > dim and shape[dim] % dim0_blocks:
            raise ValueError(
                f"LeafSplit: dimension {dim} of shape {shape} does not split into "
                f"{dim0_blocks=} tensor-parallel blocks."
            )
        return cls(shape, np.dtype(dtype), num_shards, dim0_blocks, base_spec, dim)

    @property
    def sharded(self) -> bool:
        """Whether the leaf is split (every leaf that has dimension ``dim``)."""
        return len(self.shape) > self.dim

    @property
    def block_dim0(self) -> int:
        """Rows of one tensor-parallel block (all of dim 0 without tensor parallelism)."""
        return self.shape[self.dim] // self.dim0_blocks if self.sharded else 0

    @property
    def padded_block_dim0(self) -> int:
        """:attr:`block_dim0` rounded up to a multiple of ``num_shards``."""
        return math.ceil(self.block_dim0 / self.num_shards) * self.num_shards

    @property
    def padded_shape(self) -> tuple[int, ...]:
        """The stored global shape: dim 0 padded (per block) to a multiple of ``n``."""
        if not self.sharded:
            return self.shape
        return self._with_dim(self.padded_block_dim0 * self.dim0_blocks)

    def _with_dim(self, size: int) -> tuple[int, ...]:
        return (*self.shape[: self.dim], size, *self.shape[self.dim + 1:])

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """One rank's block of the padded leaf, before any other-axis sharding."""
        if not self.sharded:
            return self.shape
        return self._with_dim(self.padded_shape[self.dim] // self.num_shards)

    @property
    def padding(self) -> int:
        """Zero rows added to dim 0 (over all blocks)."""
        return self.padded_shape[self.dim] - self.shape[self.dim] if self.sharded else 0

    def spec(self, axes: tuple[Hashable, ...]) -> P:
        """The ``PartitionSpec`` of the stored leaf when sharded over mesh ``axes``."""
        if not self.sharded:
            return self.base_spec
        entries = _spec_entries(self.base_spec, len(self.shape))
        dim0 = (*_as_tuple(entries[self.dim]), *axes)
        entries[self.dim] = dim0[0] if len(dim0) == 1 else dim0
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole padded leaf."""
        return math.prod(self.padded_shape) * self.dtype.itemsize


def make_leaf_splits(tree: Any, num_shards: int, base_specs: Any = None,
                 mesh_shape: dict[Hashable, int] | None = None) -> Any:
    """A :class:`LeafSplit` for every leaf of ``tree`` (arrays or shape-dtype structs).

    Args:
        tree: a pytree whose leaves have ``shape`` and ``dtype``.
        num_shards: the number of ranks sharing each leaf.
        base_specs: optional pytree (same structure) of each leaf's existing sharding over
            other mesh axes (tensor parallelism); ``None`` for plain replicated leaves.
        mesh_shape: axis sizes of the mesh, needed with ``base_specs``.
    """
    if base_specs is None:
        return jax.tree.map(lambda x: LeafSplit.of(np.shape(x), x.dtype, num_shards), tree)
    mesh_shape = mesh_shape or {}

    def one(x, spec):
        spec = spec if spec is not None else P()
        dim0 = _spec_entries(spec, np.ndim(x))[0] if np.ndim(x) else None
        blocks = math.prod(mesh_shape[a] for a in _as_tuple(dim0))
        return LeafSplit.of(np.shape(x), x.dtype, num_shards, dim0_blocks=blocks,
                              base_spec=spec)

    return jax.tree.map(one, tree, base_specs,
                        is_leaf=lambda s: s is None or isinstance(s, P))


def _pad_width(layout: LeafSplit, ndim: int, amount: int) -> list[tuple[int, int]]:
    width = [(0, 0)] * ndim
    width[layout.dim] = (0, amount)
    return width


def pad_leaf(x: jax.Array, layout: LeafSplit) -> jax.Array:
    """``x`` (true shape) with zero rows appended to each dim-0 block (any context)."""
    if not layout.sharded or not layout.padding:
        return x
    t, b, pb, d = layout.dim0_blocks, layout.block_dim0, layout.padded_block_dim0, layout.dim
    if t == 1:
        return jnp.pad(x, _pad_width(layout, x.ndim, pb - b))
    blocks = x.reshape(*x.shape[:d], t, b, *x.shape[d + 1:])
    width = [(0, 0)] * blocks.ndim
    width[d + 1] = (0, pb - b)
    return jnp.pad(blocks, width).reshape(layout.padded_shape)


def unpad_leaf(x: jax.Array, layout: LeafSplit) -> jax.Array:
    """The true-shape leaf from its padded form (drops each block's zero rows)."""
    if not layout.sharded or not layout.padding:
        return x
    t, b, pb, d = layout.dim0_blocks, layout.block_dim0, layout.padded_block_dim0, layout.dim
    if t == 1:
        return jax.lax.slice_in_dim(x, 0, b, axis=d)
    blocks = x.reshape(*x.shape[:d], t, pb, *x.shape[d + 1:])
    return jax.lax.slice_in_dim(blocks, 0, b, axis=d + 1).reshape(layout.shape)


def leaf_split_bytes(layouts: Any, *, per_rank: bool,
                 mesh_shape: dict[Hashable, int] | None = None) -> int:
    """Bytes of every leaf's padded form: all of it, or one rank's share.

    With ``mesh_shape``, one rank's share also divides by the leaf's split over other mesh
    axes (its ``base_spec``: tensor parallelism).
    """
    total = 0
    for lay in jax.tree.leaves(layouts, is_leaf=lambda x: isinstance(x, LeafSplit)):
        split = 1
        if per_rank and mesh_shape:
            split = math.prod(mesh_shape[a] for e in lay.base_spec for a in _as_tuple(e))
        total += lay.nbytes // (lay.num_shards if per_rank and lay.sharded else 1) // split
    return total
