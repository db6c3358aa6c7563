"""The true (unpadded) shape of every array of an FSDP state.

A parameter's stored shape has dim 0 padded to a multiple of the shard count; the
optimizer-state leaves that mirror it (``mu``, ``nu``, momentum) are padded alike. To
save a state that another world size can load, or to hand DDP whole arrays, each
stored array's true shape is needed: parameters take their layout's, optimizer leaves
that mirror a parameter (``optax.tree_map_params``) take that parameter's, and the rest
(step counts, module state) are stored as they are.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["true_shapes", "unpad_to", "state_paths"]


def _sds(shape: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), np.float32)


def _opt_true_shapes(fsdp: Any) -> Any:
    layouts = fsdp.layouts
    by_padded: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
    for lay in jax.tree.leaves(layouts):
        by_padded.setdefault(lay.padded_shape, set()).add(lay.shape)

    def by_shape(x):  # an optimizer whose init cannot take placeholders
        shape = tuple(np.shape(x))
        candidates = by_padded.get(shape, set())
        return _sds(next(iter(candidates)) if len(candidates) == 1 else shape)

    def by_layout(x, lay):
        return _sds(lay.shape if tuple(np.shape(x)) == lay.padded_shape else np.shape(x))

    try:
        out = optax.tree_map_params(fsdp.optimizer, by_layout, fsdp.opt_state, layouts,
                                    transform_non_params=by_shape)
        if len(jax.tree.leaves(out)) == len(jax.tree.leaves(fsdp.opt_state)):
            return out
    except Exception:  # noqa: BLE001 - fall back to matching shapes
        pass
    return jax.tree.map(by_shape, fsdp.opt_state)


def true_shapes(fsdp: Any) -> list[tuple[int, ...]]:
    """The true shape of each array of ``{"params", "rest", "opt_state"}``, in flatten
    order."""
    tree = {
        "params": jax.tree.map(lambda lay: _sds(lay.shape), fsdp.layouts),
        "rest": jax.tree.map(lambda x: _sds(np.shape(x)), fsdp.rest),
        "opt_state": _opt_true_shapes(fsdp),
    }
    return [tuple(s.shape) for s in jax.tree.leaves(tree)]


def state_paths(tree: Any) -> list[str]:
    """``keystr`` of every leaf of ``tree``, in flatten order."""
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def unpad_to(x: jax.Array, shape: tuple[int, ...], mesh: Any) -> jax.Array:
    """``x`` cut on dim 0 to ``shape`` and replicated over ``mesh`` (a fresh array)."""
    replicated = NamedSharding(mesh, P())
    if jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.device_put(x, replicated)
    return jax.jit(lambda v: v[: shape[0]] if v.shape != shape else jax.numpy.copy(v),
                   out_shardings=replicated)(x)
