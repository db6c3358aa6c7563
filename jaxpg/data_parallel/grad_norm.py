"""The global L2 norm of a step's averaged gradients, from per-rank code.

Inside a ``shard_map`` each rank holds its block of every gradient: the whole leaf when it
is replicated, a slice when the leaf is split (tensor parallelism, FSDP's shards, experts).
The norm of the whole gradient sums each leaf's squares over the axes that split it, and
over no other (a replicated copy would be counted once per replica).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpg.data_parallel.leaf_split import spec_axes

__all__ = ["global_grad_norm"]


def global_grad_norm(grads: Any, specs: Any = None) -> jax.Array:
    """The L2 norm over every element of every gradient, the same on every rank.

    Args:
        grads: this rank's blocks of the averaged gradients (a pytree of arrays).
        specs: the ``PartitionSpec`` of each leaf inside the ``shard_map`` (a tree shaped
            like ``grads``), or None when every leaf is replicated.

    Returns:
        A float32 scalar. Padding that the shards carry must be zero (FSDP's is).
    """
    leaves = jax.tree.leaves(grads)
    if specs is None:
        spec_leaves = [P()] * len(leaves)
    else:
        spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    if len(spec_leaves) != len(leaves):
        raise ValueError(f"global_grad_norm: {len(spec_leaves)} specs for {len(leaves)} "
                         "gradient leaves; give one PartitionSpec per leaf.")
    by_axes: dict[tuple[Any, ...], jax.Array] = {}
    for g, spec in zip(leaves, spec_leaves, strict=True):
        axes = tuple(sorted(spec_axes(spec), key=str))
        sq = jnp.sum(jnp.square(g.astype(jnp.float32)))
        by_axes[axes] = by_axes.get(axes, jnp.float32(0)) + sq
    total = jnp.float32(0)
    for axes, sq in by_axes.items():
        total = total + (jax.lax.psum(sq, axes) if axes else sq)
    return jnp.sqrt(total)
