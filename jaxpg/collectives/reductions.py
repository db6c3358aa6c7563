"""all_reduce, reduce, reduce_scatter and reduce_scatter_tensor."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpg.collectives._dispatch import (
    check_input,
    check_same_shapes,
    checked_op,
    group_rank_of,
    resolve,
    torch_form_error,
)
from jaxpg.collectives.discarded import warns_if_discarded
from jaxpg.collectives.eager import local_count, run_eager
from jaxpg.collectives.work import completed, returns_work_at_once
from jaxpg.reduce_op import ReduceOp

__all__ = [
    "all_reduce",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
]


@warns_if_discarded
@returns_work_at_once
def all_reduce(tensor: Any, op: ReduceOp = ReduceOp.SUM, group: Any = None,
               async_op: bool = False) -> Any:
    """Reduces ``tensor`` across the group; every rank gets the result.

    **Returns the result; ``tensor`` is not changed** (torch reduces in place, so torch's
    ``dist.all_reduce(t)`` is ``t = jaxpg.all_reduce(t)`` here; a discarded result warns,
    :class:`~jaxpg.DiscardedResultWarning`). In SPMD code a non-member of the group gets
    its input back.

    Example:
        >>> jaxpg.all_reduce(jnp.arange(8.0)[:, None])   # 8 local ranks, stacked
    """
    api = "all_reduce"
    pg, ctx = resolve(group, api)
    check_input(tensor, api)
    op = checked_op(op, tensor, api)
    if ctx is not None:
        return completed(ctx.lowering(pg).all_reduce(jnp.asarray(tensor), op), async_op, api)
    out = run_eager(pg, api, op, lambda lay, x: lay.all_reduce(x, op), {"x": tensor})
    return completed(out, async_op, api)


@warns_if_discarded
@returns_work_at_once
def reduce(tensor: Any, dst: int | None = None, op: ReduceOp = ReduceOp.SUM, group: Any = None,
           async_op: bool = False, group_dst: int | None = None) -> Any:
    """Reduces ``tensor`` onto rank ``dst``; other ranks get their input back unchanged.

    **Returns the result** (torch writes it into ``tensor`` on ``dst``).
    """
    api = "reduce"
    pg, ctx = resolve(group, api)
    check_input(tensor, api)
    op = checked_op(op, tensor, api)
    d = group_rank_of(pg, dst, group_dst, api, "dst")

    def body(lay: Any, x: Any) -> Any:
        return jnp.where(lay.member_index() == d, lay.all_reduce(x, op), x)

    if ctx is not None:
        return completed(body(ctx.lowering(pg), jnp.asarray(tensor)), async_op, api)
    return completed(run_eager(pg, api, (op, d), body, {"x": tensor}), async_op, api)


@warns_if_discarded
@returns_work_at_once
def reduce_scatter_tensor(input: Any, op: ReduceOp = ReduceOp.SUM, group: Any = None,  # noqa: A002
                          async_op: bool = False) -> Any:
    """Reduces ``input`` (dim 0 = group size x chunk) and gives rank ``i`` chunk ``i``.

    **Returns this rank's chunk** (torch's ``reduce_scatter_tensor(output, input)`` writes
    it into ``output``: here ``output = jaxpg.reduce_scatter_tensor(input)``).
    """
    api = "reduce_scatter_tensor"
    if _is_array_like(op):
        raise torch_form_error(api)
    pg, ctx = resolve(group, api)
    check_input(input, api, "input")
    op = checked_op(op, input, api)
    k = pg.size()
    shape = np.shape(input)
    per_rank_shape = shape if ctx is not None or local_count(pg, api) == 1 else shape[1:]
    if not per_rank_shape or per_rank_shape[0] % k:
        raise ValueError(
            f"{api}: input's dim 0 must be a multiple of the group size {k}; got shape "
            f"{tuple(per_rank_shape)}."
        )
    if ctx is not None:
        return completed(ctx.lowering(pg).reduce_scatter(jnp.asarray(input), op), async_op, api)
    out = run_eager(pg, api, op, lambda lay, x: lay.reduce_scatter(x, op), {"x": input})
    return completed(out, async_op, api)


reduce_scatter_single = reduce_scatter_tensor


@warns_if_discarded
@returns_work_at_once
def reduce_scatter(input_list: list[Any], op: ReduceOp = ReduceOp.SUM, group: Any = None,
                   async_op: bool = False) -> Any:
    """Reduces ``input_list[i]`` over ranks onto rank ``i``; **returns this rank's result**
    (torch's ``reduce_scatter(output, input_list)`` writes it into ``output``)."""
    api = "reduce_scatter"
    if isinstance(op, (list, tuple)):
        raise torch_form_error(api)
    pg, _ = resolve(group, api)
    if not isinstance(input_list, (list, tuple)) or len(input_list) != pg.size():
        n = len(input_list) if isinstance(input_list, (list, tuple)) else type(input_list)
        raise ValueError(
            f"{api}: input_list must be a list of group size {pg.size()} arrays; got {n}."
        )
    for i, x in enumerate(input_list):
        check_input(x, api, f"input_list[{i}]")
    shapes = [np.shape(x) for x in input_list]
    if len(set(shapes)) > 1:
        return completed(_reduce_scatter_uneven(pg, list(input_list), op, api), async_op, api)
    check_same_shapes(list(input_list), api, "input_list")
    axis = 1 if _stacked(pg) else 0
    joined = jnp.stack([jnp.asarray(x) for x in input_list], axis=axis)
    out = reduce_scatter_tensor(joined, op, pg, False)
    return completed(jnp.squeeze(out, axis), async_op, api)


def _reduce_scatter_uneven(pg: Any, input_list: list[Any], op: ReduceOp, api: str) -> Any:
    """torch's reduce_scatter with chunks of different shapes: each chunk is flattened and
    padded to the largest, the padded stack is reduce-scattered, and this rank keeps its
    chunk's part (host code with one rank of the group here)."""
    from jaxpg.spmd_lowering import current_context

    dtypes = {str(jnp.result_type(x)) for x in input_list}
    if len(dtypes) > 1:
        raise ValueError(f"{api}: every array in input_list must have the same dtype; got "
                         f"{sorted(dtypes)}.")
    if current_context() is not None or _stacked(pg):
        raise ValueError(
            f"{api}: input_list chunks of different shapes ({[np.shape(x) for x in input_list]}"
            ") need host code with one rank of the group in this process (the output shape "
            "depends on the rank); pad the chunks to one shape here.")
    me = pg.group_rank(pg._world.acting_rank())
    flat = [jnp.ravel(jnp.asarray(x)) for x in input_list]
    width = max(int(f.size) for f in flat)
    padded = jnp.stack([jnp.pad(f, (0, width - f.size)) for f in flat])
    out = jnp.squeeze(reduce_scatter_tensor(padded, op, pg, False), 0)
    mine = np.shape(input_list[me])
    return jnp.reshape(out[: int(np.prod(mine, dtype=int))], mine)


def _is_array_like(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, list, tuple)) or (
        hasattr(x, "__array__") and not isinstance(x, ReduceOp))


def _stacked(pg: Any) -> bool:
    from jaxpg.spmd_lowering import current_context

    return current_context() is None and len(pg.local_members()) > 1
