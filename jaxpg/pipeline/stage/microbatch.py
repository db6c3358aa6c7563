"""Microbatching: split a batch into ``m`` equal microbatches and merge outputs back.

Microbatch ``i`` holds the contiguous samples ``[i * b, (i + 1) * b)`` of the batch
dimension, where ``b = batch_size // m``; ``merge_microbatches`` is the exact inverse.
Every leaf of the pytree is split along the same dimension, so inputs and targets stay
aligned.

Example:
    >>> import jax.numpy as jnp
    >>> mbs = split_microbatches({"x": jnp.zeros((8, 3))}, 4)
    >>> mbs["x"].shape
    (4, 2, 3)
    >>> merge_microbatches(mbs)["x"].shape
    (8, 3)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["split_microbatches", "merge_microbatches", "microbatch_size"]


def microbatch_size(batch: Any, num_microbatches: int, axis: int = 0) -> int:
    """Returns the microbatch size of ``batch``, after checking that it divides evenly.

    Args:
        batch: a pytree of arrays that share the size of dimension ``axis``.
        num_microbatches: the number ``m`` of microbatches.
        axis: the batch dimension of every leaf.

    Raises:
        TypeError: if ``num_microbatches`` is not an int.
        ValueError: if ``num_microbatches < 1``, the leaves disagree on the batch size,
            or the batch size is not a multiple of ``num_microbatches``.
    """
    if not isinstance(num_microbatches, int) or isinstance(num_microbatches, bool):
        raise TypeError(f"num_microbatches must be an int, got {num_microbatches!r}.")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}.")
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("batch has no arrays to split into microbatches.")
    sizes = {jnp.shape(leaf)[axis] for leaf in leaves}
    if len(sizes) != 1:
        raise ValueError(
            f"Every leaf of batch must have the same size along dimension {axis}; "
            f"got sizes {sorted(sizes)}."
        )
    (size,) = sizes
    if size % num_microbatches:
        raise ValueError(
            f"batch size {size} (dimension {axis}) is not divisible by "
            f"num_microbatches={num_microbatches}; choose a batch size that is a multiple "
            f"of {num_microbatches}, or a num_microbatches that divides {size}."
        )
    return size // num_microbatches


def split_microbatches(batch: Any, num_microbatches: int, axis: int = 0) -> Any:
    """Splits every leaf of ``batch`` into ``num_microbatches`` along ``axis``.

    Args:
        batch: a pytree of arrays sharing the size of dimension ``axis``.
        num_microbatches: the number ``m`` of microbatches.
        axis: the batch dimension.

    Returns:
        The same pytree, each leaf with a new leading dimension of size ``m`` and
        dimension ``axis`` (now ``axis + 1``) shrunk to ``batch_size // m``.
    """
    size = microbatch_size(batch, num_microbatches, axis)

    def split(leaf):
        leaf = jnp.asarray(leaf)
        ax = axis % leaf.ndim
        shape = leaf.shape[:ax] + (num_microbatches, size) + leaf.shape[ax + 1 :]
        return jnp.moveaxis(leaf.reshape(shape), ax, 0)

    return jax.tree.map(split, batch)


def merge_microbatches(microbatches: Any, axis: int = 0) -> Any:
    """Merges the leading microbatch dimension back into dimension ``axis``.

    The inverse of ``split_microbatches``: a leaf of shape ``[m, ..., b, ...]`` becomes
    ``[..., m * b, ...]``.

    Args:
        microbatches: a pytree whose leaves have the microbatch dimension first.
        axis: the batch dimension of the merged leaves.

    Raises:
        ValueError: if a leaf has no microbatch dimension and batch dimension.
    """

    def merge(leaf):
        leaf = jnp.asarray(leaf)
        if leaf.ndim < 2:
            raise ValueError(
                "merge_microbatches needs leaves of shape [m, ..., batch, ...]; got a leaf "
                f"of shape {leaf.shape}."
            )
        ax = axis % (leaf.ndim - 1)
        moved = jnp.moveaxis(leaf, 0, ax)
        shape = moved.shape[:ax] + (moved.shape[ax] * moved.shape[ax + 1],) + moved.shape[ax + 2 :]
        return moved.reshape(shape)

    return jax.tree.map(merge, microbatches)
