"""Moving FSDP state between its stored form and whole arrays.

The stored form of a parameter (and of each optimizer-state leaf that mirrors one) is
its :class:`~jaxpg.ddp.shard_layout.ShardLayout`'s padded global array, split on dim 0
over the shard axes (stage 3), or the whole array replicated (stages 1 and 2). These
helpers pad and shard whole values, unpad and gather stored ones, and fit any value of
a compatible shape (the same but for dim 0's zero padding) into a stored leaf's shape
and sharding, which is how a state saved at another world size or stage is loaded.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxpg.ddp.shard_layout import pad_leaf, unpad_leaf

__all__ = ["shard_params", "gather_params", "fit_leaf", "check_fits", "shard_bytes"]


def shard_params(params: Any, layouts: Any, mesh: Any, axes: tuple[Any, ...]) -> Any:
    """Whole parameters (global arrays on ``mesh``) -> padded, split over ``axes``."""
    shardings = jax.tree.map(lambda lay: NamedSharding(mesh, lay.spec(axes)), layouts)
    return jax.jit(lambda p: jax.tree.map(pad_leaf, p, layouts),
                   out_shardings=shardings)(params)


def gather_params(params: Any, layouts: Any, mesh: Any) -> Any:
    """Stored parameters -> whole (unpadded) arrays, replicated over ``mesh``."""
    shardings = jax.tree.map(lambda lay: NamedSharding(mesh, lay.base_spec), layouts)
    return jax.jit(lambda p: jax.tree.map(unpad_leaf, p, layouts),
                   out_shardings=shardings)(params)


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
    if jnp.issubdtype(target.dtype, jax.dtypes.prng_key):
        return jax.device_put(value, sharding)

    def fit(x):
        x = x.astype(target.dtype)
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
