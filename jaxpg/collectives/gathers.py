"""all_gather, all_gather_into_tensor, gather, broadcast and scatter."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpg.collectives._dispatch import (
    check_input,
    check_inputs,
    check_same_shapes,
    group_rank_of,
    resolve,
    torch_form_error,
)
from jaxpg.collectives.discarded import warns_if_discarded
from jaxpg.collectives.eager import local_count, run_eager
from jaxpg.collectives.work import completed, returns_work_at_once

__all__ = [
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "gather",
    "broadcast",
    "scatter",
    "exchange_sizes",
]


def exchange_sizes(pg: Any, local_sizes: np.ndarray, api: str) -> np.ndarray:
    """Returns every member's int vector, [members, n], given this process's [n_local, n].

    One process holding every member needs no communication; otherwise a small all_gather
    runs first (the sizes torch's callers pass through their output buffers).
    """
    local_sizes = np.asarray(local_sizes, np.int32)
    if len(pg.local_members()) == len(pg.members):
        return local_sizes
    stacked = local_sizes[0] if len(pg.local_members()) == 1 else local_sizes
    out = run_eager(pg, api + ".sizes", None, lambda lay, x: lay.gather(x), {"x": stacked})
    out = np.asarray(jax.device_get(out))
    return out if out.ndim == 2 else out[0]


def _pad_dim0(x: jax.Array, size: int) -> jax.Array:
    pad = size - x.shape[0]
    return x if pad == 0 else jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))


@warns_if_discarded
@returns_work_at_once
def all_gather(tensor: Any, group: Any = None, async_op: bool = False) -> Any:
    """Gathers every rank's ``tensor``; **returns** a list indexed by group rank.

    torch's ``all_gather(tensor_list, tensor)`` fills ``tensor_list``; here it is
    ``tensor_list = jaxpg.all_gather(tensor)`` (torch's form raises a TypeError saying so).

    Dim 0 may differ between ranks (eager only): each rank passes its own array, or, in a
    process holding several ranks, a tuple of its ranks' arrays. In SPMD code every rank's
    shape is the same (shapes are static).
    """
    api = "all_gather"
    pg, ctx = resolve(group, api)
    check_inputs(tensor, api)
    if ctx is not None:
        stack = ctx.lowering(pg).gather(jnp.asarray(tensor))
        return completed([stack[i] for i in range(pg.size())], async_op, api)
    n_local = local_count(pg, api)
    per_rank = isinstance(tensor, (tuple, list))
    if per_rank and len(tensor) != n_local:
        raise ValueError(
            f"{api}: tensor is a tuple of per-rank arrays, so it needs one per local rank of "
            f"the group ({n_local}); got {len(tensor)}."
        )
    arrays = [jnp.asarray(t) for t in tensor] if per_rank else None
    if arrays is not None:
        trailing = {a.shape[1:] for a in arrays}
        if len(trailing) > 1 or arrays[0].ndim == 0:
            raise ValueError(f"{api}: per-rank arrays may differ in dim 0 only; got "
                             f"shapes {[a.shape for a in arrays]}.")
        local_dim0 = np.array([[a.shape[0]] for a in arrays])
    else:
        shape = np.shape(tensor)
        local_dim0 = (np.array([[shape[0] if shape else 1]]) if n_local == 1
                      else np.full((n_local, 1), shape[1] if len(shape) > 1 else 1))
    multiprocess = len(pg.local_members()) < len(pg.members)
    sizes = exchange_sizes(pg, local_dim0, api)[:, 0] if (per_rank or multiprocess) else None
    if sizes is None or len(set(sizes.tolist())) == 1 and not per_rank:
        stack = run_eager(pg, api, None, lambda lay, x: lay.gather(x), {"x": tensor})
        axis = 0 if n_local == 1 else 1
        out = [jnp.take(stack, i, axis=axis) for i in range(pg.size())]
        return completed(out, async_op, api)
    biggest = int(sizes.max())
    if per_rank:
        padded = [_pad_dim0(a, biggest) for a in arrays]
        padded = padded[0] if n_local == 1 else jnp.stack(padded)
    else:
        padded = _pad_dim0(jnp.asarray(tensor), biggest) if n_local == 1 else tensor
    stack = run_eager(pg, api, biggest, lambda lay, x: lay.gather(x), {"x": padded})
    # One local rank: the sizes are its own subgroup's, in group-rank order (a family of
    # subgroups, such as a DeviceMesh dimension's, has more members than one group's ranks).
    by_rank = {r: int(s) for r, s in zip(pg.ranks if n_local == 1 else pg.members, sizes)}
    out = []
    for i, r in enumerate(pg.ranks):
        part = jnp.take(stack, i, axis=0 if n_local == 1 else 1)
        out.append(part[: by_rank[r]] if n_local == 1 else part[:, : by_rank[r]])
    return completed(out, async_op, api)


@warns_if_discarded
@returns_work_at_once
def all_gather_into_tensor(input_tensor: Any, group: Any = None, async_op: bool = False) -> Any:
    """Gathers every rank's ``input_tensor`` concatenated along dim 0; **returns** what torch
    writes into ``output_tensor`` (``output_tensor = jaxpg.all_gather_into_tensor(x)``)."""
    api = "all_gather_into_tensor"
    pg, ctx = resolve(group, api)
    check_input(input_tensor, api, "input_tensor")

    def body(lay: Any, x: Any) -> Any:
        stack = lay.gather(x)
        return stack.reshape((-1, *x.shape[1:])) if x.ndim else stack

    if ctx is not None:
        return completed(body(ctx.lowering(pg), jnp.asarray(input_tensor)), async_op, api)
    return completed(run_eager(pg, api, None, body, {"x": input_tensor}), async_op, api)


all_gather_single = all_gather_into_tensor


@warns_if_discarded
@returns_work_at_once
def broadcast(tensor: Any, src: int | None = None, group: Any = None, async_op: bool = False,
              group_src: int | None = None) -> Any:
    """Every rank gets rank ``src``'s ``tensor`` (``src`` is a global rank, as in torch).

    **Returns the result; ``tensor`` is not changed** (torch's ``dist.broadcast(t, src)`` is
    ``t = jaxpg.broadcast(t, src)`` here).
    """
    api = "broadcast"
    pg, ctx = resolve(group, api)
    check_input(tensor, api)
    s = group_rank_of(pg, src, group_src, api, "src")
    if ctx is not None:
        return completed(ctx.lowering(pg).broadcast(jnp.asarray(tensor), s), async_op, api)
    out = run_eager(pg, api, s, lambda lay, x: lay.broadcast(x, s), {"x": tensor})
    return completed(out, async_op, api)


@warns_if_discarded
@returns_work_at_once
def gather(tensor: Any, dst: int | None = None, group: Any = None, async_op: bool = False,
           group_dst: int | None = None, *, gather_list: Any = None) -> Any:
    """Gathers every rank's ``tensor`` onto ``dst``: a list there, None on other ranks.

    torch fills ``gather_list`` on ``dst``; jaxpg **returns** the list instead
    (``gather_list = jaxpg.gather(tensor, dst=0)``; passing ``gather_list`` raises a
    TypeError saying so). In SPMD code every rank gets the list (shapes are static), and
    only ``dst``'s is meaningful by contract.
    """
    api = "gather"
    if gather_list is not None or isinstance(dst, (list, tuple)):
        raise torch_form_error(api)
    pg, ctx = resolve(group, api)
    check_input(tensor, api)
    d = group_rank_of(pg, dst, group_dst, api, "dst")
    if ctx is not None:
        stack = ctx.lowering(pg).gather(jnp.asarray(tensor))
        return completed([stack[i] for i in range(pg.size())], async_op, api)
    holds_dst = pg.ranks[d] in pg._world.local_ranks
    stack = run_eager(pg, api, d, lambda lay, x: lay.gather(x), {"x": tensor})
    if not holds_dst:
        return completed(None, async_op, api)
    local = pg.local_members()
    row = stack if len(local) == 1 else stack[local.index(pg.ranks[d])]
    return completed([row[i] for i in range(pg.size())], async_op, api)


@warns_if_discarded
@returns_work_at_once
def scatter(tensor: Any = None, scatter_list: list[Any] | None = None, src: int | None = None,
            group: Any = None, async_op: bool = False, group_src: int | None = None) -> Any:
    """Rank ``i`` gets ``scatter_list[i]`` from ``src``; returns this rank's part.

    ``scatter_list`` is given on ``src`` only (None or ``[]`` elsewhere). ``tensor`` is
    torch's output buffer: here it only gives the shape and dtype on ranks that do not hold
    ``src`` (its values are unused), and the part is **returned**
    (``tensor = jaxpg.scatter(tensor, scatter_list, src=0)``).
    """
    api = "scatter"
    pg, ctx = resolve(group, api)
    if tensor is not None:
        check_input(tensor, api)
    for i, x in enumerate(scatter_list or []):
        check_input(x, api, f"scatter_list[{i}]")
    s = group_rank_of(pg, src, group_src, api, "src")
    k = pg.size()
    if ctx is not None:
        if scatter_list is None or len(scatter_list) != k:
            raise ValueError(f"{api}: in SPMD code every rank passes scatter_list with {k} "
                             "arrays (only src's values are used).")
        check_same_shapes(list(scatter_list), api, "scatter_list")
        rows = jnp.stack([jnp.asarray(x) for x in scatter_list])
        lay = ctx.lowering(pg)
        mine = lay.all_to_all(rows)[s]
        return completed(lay.keep_for_nonmembers(mine, rows[0]), async_op, api)
    holds_src = pg.ranks[s] in pg._world.local_ranks
    n_local = local_count(pg, api)
    if not holds_src and scatter_list is not None and len(scatter_list) == 0:
        scatter_list = None  # torch tests truthiness: [] off the source means "none"
    if holds_src and not scatter_list:
        raise ValueError(f"{api}: this process holds src={pg.ranks[s]}, so it must pass "
                         f"scatter_list with {k} arrays.")
    if not holds_src and scatter_list is not None:
        raise ValueError(
            f"{api}: scatter_list must be None on ranks other than src={pg.ranks[s]}; this "
            f"process holds ranks {pg.local_members()}."
        )
    if scatter_list is not None:
        if len(scatter_list) != k:
            raise ValueError(f"{api}: scatter_list has {len(scatter_list)} arrays; the group "
                             f"has {k} ranks.")
        check_same_shapes(list(scatter_list), api, "scatter_list")
        rows = jnp.stack([jnp.asarray(x) for x in scatter_list])
    else:
        if tensor is None:
            raise ValueError(f"{api}: ranks other than src must pass tensor (torch's output "
                             "buffer) so the result's shape and dtype are known.")
        template = jnp.asarray(tensor)
        shape = template.shape if n_local == 1 else template.shape[1:]
        rows = jnp.zeros((k, *shape), template.dtype)
    # every local rank that is src of its subgroup (of the family) sends scatter_list
    src_ranks = {sub[s] for sub in pg.family if s < len(sub)}
    data = rows if n_local == 1 else jnp.stack(
        [rows if r in src_ranks and holds_src else jnp.zeros_like(rows)
         for r in pg.local_members()])
    out = run_eager(pg, api, s, lambda lay, x: lay.all_to_all(x)[s], {"x": data})
    return completed(out, async_op, api)
