"""Shared front matter of every collective: resolve the group, pick the lowering."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpg.groups import world as _world
from jaxpg.reduce_op import ReduceOp, as_reduce_op
from jaxpg.spmd import SpmdContext, current_context

__all__ = ["resolve", "is_traced", "check_same_shapes", "group_rank_of", "checked_op"]

_checked_ops: dict[tuple[Any, Any], ReduceOp] = {}


def resolve(group: Any, api: str) -> tuple[Any, SpmdContext | None]:
    """Returns ``(ProcessGroup, active SPMD context or None)``."""
    pg = _world._resolve_group(group, api)
    return pg, current_context()


def checked_op(op: Any, x: Any, api: str) -> ReduceOp:
    """``as_reduce_op(op, dtype of x)``, remembered per (op, dtype): a small eager call
    should not pay for the dtype checks every time."""
    dtype = x.dtype if isinstance(x, (jax.Array, np.ndarray)) else jnp.result_type(x)
    try:
        key = (op, dtype)
        checked = _checked_ops.get(key)
    except TypeError:  # an unhashable op: as_reduce_op says what is wrong with it
        return as_reduce_op(op, dtype, api=api)
    if checked is None:
        checked = as_reduce_op(op, dtype, api=api)
        if len(_checked_ops) >= 1024:  # e.g. a new PREMUL_SUM factor every step
            _checked_ops.clear()
        _checked_ops[key] = checked
    return checked


def is_traced(x: Any) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(x))


def check_same_shapes(arrays: list[Any], api: str, arg: str) -> None:
    """Raises if the arrays of a list argument differ in shape or dtype."""
    def sig(a: Any) -> tuple:
        return np.shape(a), str(jnp.result_type(a))

    first = sig(arrays[0])
    for i, a in enumerate(arrays[1:], 1):
        if sig(a) != first:
            raise ValueError(
                f"{api}: every array in {arg} must have the same shape and dtype; {arg}[0] is "
                f"{first[0]} {first[1]} but {arg}[{i}] is {sig(a)[0]} {sig(a)[1]}."
            )


def group_rank_of(pg: Any, global_rank: int | None, group_rank: int | None, api: str,
                  arg: str) -> int:
    """Turns torch's ``src``/``dst`` (global) or ``group_src``/``group_dst`` into a group rank."""
    if global_rank is not None and group_rank is not None:
        raise ValueError(f"{api}: pass {arg} or group_{arg}, not both.")
    if group_rank is not None:
        if not 0 <= group_rank < pg.size():
            raise ValueError(
                f"{api}: group_{arg}={group_rank} is out of range for group "
                f"{pg.group_name!r} of size {pg.size()}."
            )
        return int(group_rank)
    if global_rank is None:
        global_rank = 0
    r = pg.group_rank(global_rank)
    if r < 0:
        raise ValueError(
            f"{api}: {arg}={global_rank} is not a rank of group {pg.group_name!r} "
            f"(ranks {list(pg.ranks)}); pass a global rank of the group, or group_{arg}."
        )
    return r
