"""Moving FSDP state between its stored form and whole arrays.

The stored form of a parameter (and of each optimizer-state leaf that mirrors one) is
its :class:`~jaxpg.data_parallel.leaf_split.LeafSplit`'s padded global array, split on dim 0
over the shard axes (stage 3), or the whole array replicated (stages 1 and 2). These
helpers pad and shard whole values, unpad and gather stored ones, and fit any value of
a compatible shape (the same but for dim 0's zero padding) into a stored leaf's shape
and sharding, which is how a state saved at another world size or stage is loaded.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.data_parallel.leaf_split import pad_leaf, unpad_leaf

__all__ = ["shard_params", "gather_params", "fit_leaf", "check_fits", "shard_bytes"]


@functools.lru_cache(maxsize=64)
def _pad_and_split(layouts: tuple[Any, ...], shardings: tuple[Any, ...]) -> Any:
    def pad(*leaves):
        return tuple(pad_leaf(x, lay) for x, lay in zip(leaves, layouts, strict=True))

    return jax.jit(pad, out_shardings=shardings)


@functools.lru_cache(maxsize=64)
def _unpad_and_join(layouts: tuple[Any, ...], shardings: tuple[Any, ...]) -> Any:
    def unpad(*leaves):
        return tuple(unpad_leaf(x, lay) for x, lay in zip(leaves, layouts, strict=True))

    return jax.jit(unpad, out_shardings=shardings)


def shard_params(params: Any, layouts: Any, mesh: Any, axes: tuple[Any, ...]) -> Any:
    """Whole parameters (global arrays on ``mesh``) -> padded, split over ``axes``."""
    leaves, treedef = jax.tree.flatten(params)
    lays = tuple(treedef.flatten_up_to(layouts))
    shardings = tuple(NamedSharding(mesh, lay.spec(axes)) for lay in lays)
    return jax.tree.unflatten(treedef, _pad_and_split(lays, shardings)(*leaves))


def gather_params(params: Any, layouts: Any, mesh: Any) -> Any:
    """Stored parameters -> whole (unpadded) arrays, replicated over ``mesh``."""
    leaves, treedef = jax.tree.flatten(params)
    lays = tuple(treedef.flatten_up_to(layouts))
    shardings = tuple(NamedSharding(mesh, lay.base_spec) for lay in lays)
    return jax.tree.unflatten(treedef, _unpad_and_join(lays, shardings)(*leaves))


def check_fits(path: str, shape: tuple[int, ...], true_shape: tuple[int, ...] | None,
               target_true_shape: tuple[int, ...], what: str) -> None:
    """Raises unless a value of ``shape`` can load into a leaf whose true shape is
    ``target_true_shape``.

    ``true_shape`` is the value's own true shape when known (a checkpoint records it);
    with None, any ``shape`` that differs from the target only by extra rows on dim 0
    (another world size's zero padding) is taken.

    Raises:
        ValueError: naming ``path``, both shapes and what to do.
    """
    shape, target = tuple(shape), tuple(target_true_shape)
    if true_shape is not None:
        ok = tuple(true_shape) == target
    else:
        ok = shape == target or (len(shape) == len(target) and len(shape) > 0
                                 and shape[1:] == target[1:] and shape[0] >= target[0])
    if not ok:
        shown = tuple(true_shape) if true_shape is not None else shape
        padded = f" (stored padded as {shape})" if shown != shape else ""
        raise ValueError(
            f"{what}: {path} has shape {shown}{padded}, this model's is {target}; load a "
            "state of the same model (layer sizes) and optimizer."
        )


def fit_leaf(value: Any, target: jax.Array) -> jax.Array:
    """``value`` padded with zero rows or cut on dim 0 to ``target``'s shape, placed with
    ``target``'s sharding (a fresh array; ``value`` may be numpy or any jax.Array)."""
    shape = tuple(target.shape)
    sharding = target.sharding
    if isinstance(value, np.ndarray | np.generic | int | float):
        value = np.asarray(value, dtype=target.dtype)
        fitted = _fit_numpy(value, shape)
        return jax.make_array_from_callback(shape, sharding, lambda idx: fitted[idx])
    if jnp.issubdtype(target.dtype, jax.dtypes.prng_key):  # through the key data
        impl = jax.random.key_impl(target)
        data = jax.random.key_data(value)
        struct = jax.ShapeDtypeStruct((*shape, *data.shape[len(shape):]), data.dtype,
                                      sharding=sharding)
        return jax.random.wrap_key_data(fit_leaf(data, struct), impl=impl)
    if value.sharding.device_set != sharding.device_set:  # another mesh: bring it over
        value = jax.device_put(value, NamedSharding(sharding.mesh, P()))

    def fit(x):  # always a fresh buffer: the caller's array may be donated later
        x = jnp.copy(x.astype(target.dtype))
        if x.shape == shape:
            return x
        if x.shape[0] < shape[0]:
            return jnp.pad(x, [(0, shape[0] - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
        return x[: shape[0]]

    return jax.jit(fit, out_shardings=sharding)(value)


def _fit_numpy(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if x.shape == shape:
        return x
    if x.shape[0] < shape[0]:
        return np.pad(x, [(0, shape[0] - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    return x[: shape[0]]


def shard_bytes(tree: Any) -> int:
    """Bytes of ``tree``'s arrays held by one device (the first shard of each array)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            total += leaf.addressable_shards[0].data.nbytes
    return total
