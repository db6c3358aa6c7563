"""ZeRO-1: the optimizer state split over the data-parallel ranks, each updating its shard.

torch's ``ZeroRedundancyOptimizer`` and Paddle's ``DygraphShardingOptimizer`` give every
rank the optimizer state of a part of the parameters: after the gradient all-reduce each
rank steps its part and broadcasts the new values. Here the state is a pytree of global
``jax.Array`` s, each param-shaped leaf padded on dim 0 to a multiple of the rank count and
laid out ``P(axis)`` over the group (:mod:`jaxpg.data_parallel.leaf_split`); the update is written
on those global arrays *outside* ``shard_map`` but inside the same ``jit``, so XLA's SPMD
partitioner gives each rank its shard of every element-wise operation and turns whole-tree
reductions into all-reduces:

* element-wise transforms (``sgd``, momentum, ``adam``, ``adamw``, ``lion``, weight decay,
  schedules) run on the local shard only, with no communication;
* whole-tree transforms (``clip_by_global_norm``, ``scale_by_trust_ratio``, anything
  calling ``optax.global_norm``) read every shard: their sums become all-reduces of a
  scalar, so the result equals the unsharded update (the zero padding adds nothing to a
  sum of squares);
* a transform that depends on a leaf's shape (``adafactor``'s factored moments) sees the
  padded shape when dim 0 does not divide by the rank count; pick such dimensions
  divisible by the rank count for exact results.

The new parameters are then laid out as the caller wants them: replicated for ZeRO-1 and
2 (XLA all-gathers the updated shards), sharded for ZeRO-3 / FSDP.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.data_parallel.leaf_split import LeafSplit, pad_leaf, unpad_leaf

__all__ = [
    "ZERO_STAGES", "PADDLE_LEVELS", "resolve_zero_stage", "opt_state_shardings",
    "abstract_sharded_opt_state", "init_sharded_opt_state",
    "sharded_update", "padded_params",
]


ZERO_STAGES = {0: "nothing sharded (replicated)", 1: "the optimizer state",
               2: "the optimizer state and gradients",
               3: "the optimizer state, gradients and parameters"}
"""What each ZeRO stage splits over the data-parallel ranks: ``zero_stage=`` everywhere."""

PADDLE_LEVELS = {"os": 1, "os_g": 2, "p_g_os": 3}
"""Paddle's ``group_sharded_parallel(level=...)`` names of stages 1 to 3."""


def resolve_zero_stage(api: str, allowed: tuple[int, ...], default: int,
                       zero_stage: int | None, hint: str = "", **aliases: Any) -> int:
    """The ZeRO stage that ``zero_stage=`` or one of its aliases names.

    Args:
        api: the caller's name, for errors.
        allowed: the stages the caller runs.
        default: the stage when none is passed.
        zero_stage: the ``zero_stage=`` argument (None: not passed).
        hint: said after the error for a stage outside ``allowed`` (where to find it).
        **aliases: each alias' name and the stage it names (None: not passed), already
            mapped to an int (``stage=2``, ``shard_optimizer_state=True`` as 1, Paddle's
            ``level='os_g'`` as 2).

    Raises:
        ValueError: for more than one spelling passed, or a stage outside ``allowed``.
    """
    given = {"zero_stage": zero_stage, **aliases}
    passed = {k: v for k, v in given.items() if v is not None}
    if len(passed) > 1:
        both = " and ".join(f"{k}=" for k in passed)
        raise ValueError(f"{api}: pass zero_stage= only, not {both}: they name the same ZeRO "
                         "stage.")
    name, stage = next(iter(passed.items()), ("zero_stage", default))
    if isinstance(stage, bool) or stage not in allowed:
        known = ", ".join(f"{k} ({ZERO_STAGES[k]})" for k in allowed)
        raise ValueError(f"{api}: {name}={stage!r} is not a ZeRO stage it runs; pass "
                         f"zero_stage= one of {known}.{hint}")
    return stage


def _is_layout(x: Any) -> bool:
    return isinstance(x, LeafSplit)


def _axes_entry(axes: tuple[Hashable, ...]) -> Any:
    return axes[0] if len(axes) == 1 else tuple(axes)


def opt_state_shardings(optimizer: optax.GradientTransformation, abstract_state: Any,
                        layouts: Any, mesh: Mesh, axes: tuple[Hashable, ...]) -> Any:
    """The sharding of every optimizer-state leaf over ``axes`` of ``mesh``.

    Leaves that mirror a parameter (``mu``, ``nu``, momentum: found with
    ``optax.tree_map_params``) take that parameter's layout; any other leaf with a dim 0
    divisible by the rank count is split on dim 0, and the rest (step counts, scalars)
    are replicated. Shardings only place memory: the update is correct for any of them.
    """
    n = math.prod(mesh.shape[a] for a in axes)
    replicated = NamedSharding(mesh, P())

    def by_shape(x):
        if np.ndim(x) and x.shape[0] and x.shape[0] % n == 0:
            return NamedSharding(mesh, P(_axes_entry(axes)))
        return replicated

    def by_layout(x, layout):
        if not hasattr(x, "shape") or tuple(x.shape) != layout.padded_shape:
            return by_shape(x)
        return NamedSharding(mesh, layout.spec(axes))

    try:
        out = optax.tree_map_params(optimizer, by_layout, abstract_state, layouts,
                                    transform_non_params=by_shape)
        if len(jax.tree.leaves(out)) == len(jax.tree.leaves(abstract_state)):
            return out
    except Exception:  # noqa: BLE001 - an init that cannot take placeholders: use shapes
        pass
    return jax.tree.map(by_shape, abstract_state)


def padded_params(params: Any, layouts: Any, mesh: Mesh, axes: tuple[Hashable, ...]) -> Any:
    """``params`` (true shapes, any layout) padded and split over ``axes`` (global view)."""
    return jax.tree.map(
        lambda x, lay: jax.lax.with_sharding_constraint(
            pad_leaf(x, lay), NamedSharding(mesh, lay.spec(axes))),
        params, layouts)


def _opt_init(optimizer: optax.GradientTransformation, layouts: Any, mesh: Mesh,
              axes: tuple[Hashable, ...], params_padded: bool) -> Any:
    def init(p):
        return optimizer.init(p if params_padded else padded_params(p, layouts, mesh, axes))

    return init


def abstract_sharded_opt_state(optimizer: optax.GradientTransformation, params: Any,
                               layouts: Any, mesh: Mesh, axes: tuple[Hashable, ...], *,
                               params_padded: bool) -> tuple[Any, Any]:
    """``(shape-dtype structs with shardings, shardings)`` of the sharded optimizer state
    of ``params`` (arrays or structs); nothing is allocated."""
    abstract = jax.eval_shape(_opt_init(optimizer, layouts, mesh, axes, params_padded), params)
    shardings = opt_state_shardings(optimizer, abstract, layouts, mesh, axes)
    structs = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                           abstract, shardings)
    return structs, shardings


def init_sharded_opt_state(optimizer: optax.GradientTransformation, params: Any, layouts: Any,
                           mesh: Mesh, axes: tuple[Hashable, ...], *,
                           params_padded: bool) -> tuple[Any, Any]:
    """The optimizer state of ``params``, sharded; returns ``(opt_state, shardings)``.

    Args:
        optimizer: the optax transformation.
        params: the parameters: padded and sharded (``params_padded``) or true-shape.
        layouts: a :class:`LeafSplit` per parameter.
        mesh: the mesh holding ``axes``.
        axes: the mesh axes the state is split over.
        params_padded: whether ``params`` are already in their padded form.
    """
    _, shardings = abstract_sharded_opt_state(optimizer, params, layouts, mesh, axes,
                                              params_padded=params_padded)
    init = _opt_init(optimizer, layouts, mesh, axes, params_padded)
    return jax.jit(init, out_shardings=shardings)(params), shardings


def sharded_update(optimizer: optax.GradientTransformation, grads: Any, opt_state: Any,
                   params: Any, layouts: Any, *, mesh: Mesh, axes: tuple[Hashable, ...],
                   opt_shardings: Any, grads_padded: bool, params_padded: bool) -> tuple[Any, Any]:
    """One optax step on sharded state, written on global arrays (call inside ``jit``).

    Args:
        optimizer: the optax transformation.
        grads: the averaged gradients: padded and sharded (ZeRO-2/3, ``grads_padded``), or
            true-shape and replicated (ZeRO-1, after an all-reduce).
        opt_state: the sharded optimizer state (:func:`init_sharded_opt_state`).
        params: the parameters: padded and sharded (ZeRO-3, ``params_padded``) or
            true-shape and replicated.
        layouts: a :class:`LeafSplit` per parameter.
        mesh: the mesh holding ``axes``.
        axes: the mesh axes the state is split over.
        opt_shardings: the optimizer state's shardings.
        grads_padded: see ``grads``.
        params_padded: see ``params``; the new parameters come back in the same form
            (replicated parameters are all-gathered from the updated shards).

    Returns:
        ``(new_params, new_opt_state)``.
    """
    shard = lambda lay: NamedSharding(mesh, lay.spec(axes))
    g = grads if grads_padded else padded_params(grads, layouts, mesh, axes)
    p = params if params_padded else padded_params(params, layouts, mesh, axes)
    updates, new_opt = optimizer.update(g, opt_state, p)
    new_opt = jax.lax.with_sharding_constraint(new_opt, opt_shardings)
    updates = jax.tree.map(lambda u, lay: jax.lax.with_sharding_constraint(u, shard(lay)),
                           updates, layouts)
    new_p = optax.apply_updates(p, updates)
    if params_padded:
        new_p = jax.tree.map(lambda x, lay: jax.lax.with_sharding_constraint(x, shard(lay)),
                             new_p, layouts)
        return new_p, new_opt
    new_params = jax.tree.map(
        lambda x, lay: jax.lax.with_sharding_constraint(
            unpad_leaf(x, lay), NamedSharding(mesh, lay.base_spec)),
        new_p, layouts)
    return new_params, new_opt
