"""all_to_all (lists, per-pair sizes may differ) and all_to_all_single (split sizes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxpg.collectives._dispatch import check_input, check_inputs, resolve, torch_form_error
from jaxpg.collectives.discarded import warns_if_discarded
from jaxpg.collectives.eager import local_count, run_eager
from jaxpg.collectives.gathers import exchange_sizes
from jaxpg.collectives.work import completed, returns_work_at_once

__all__ = ["all_to_all", "all_to_all_single"]


def _is_data(x: Any) -> bool:
    return x is not None and (isinstance(x, (list, tuple)) or hasattr(x, "__array__"))


def _is_sizes(x: Any) -> bool:
    """Split sizes: ints, per-rank lists of ints, or an integer array (not float data)."""
    if isinstance(x, (list, tuple)):
        return all(isinstance(v, (int, np.integer)) or _is_sizes(v) for v in x)
    try:
        return np.asarray(x).dtype.kind in "iu"
    except Exception:  # noqa: BLE001 (not convertible: not sizes)
        return False


def _exchange(pg: Any, chunks: list[list[Any]], api: str) -> list[list[Any]]:
    """Eager core: ``chunks[l][i]`` (local rank l's array for group rank i) -> received.

    Returns ``received[l][i]``: what local rank ``l`` got from group rank ``i``. Chunks may
    differ in dim 0; they are padded to the largest, exchanged in one kernel and cut back.
    """
    k = pg.size()
    local = pg.local_members()
    sizes = np.array([[c.shape[0] if c.ndim else 1 for c in row] for row in chunks])
    all_sizes = exchange_sizes(pg, sizes, api)  # [members, k]: member m sends sizes[m][i] to i
    biggest = int(all_sizes.max()) if all_sizes.size else 0
    trailing = chunks[0][0].shape[1:]
    padded = []
    for row in chunks:
        padded.append(jnp.stack([
            jnp.pad(c, [(0, biggest - c.shape[0])] + [(0, 0)] * (c.ndim - 1)) for c in row
        ]))
    data = padded[0] if len(local) == 1 else jnp.stack(padded)
    out = run_eager(pg, api, biggest, lambda lay, x: lay.all_to_all(x), {"x": data})
    member_pos = {r: p for p, r in enumerate(pg.members)}
    received = []
    for li, r in enumerate(local):
        got = out if len(local) == 1 else out[li]
        me = pg.group_rank(r)
        row = []
        for i in range(k):
            n = int(all_sizes[member_pos[pg.ranks[i]], me])
            row.append(got[i][:n].reshape((n, *trailing)))
        received.append(row)
    return received


@warns_if_discarded
@returns_work_at_once
def all_to_all(input_tensor_list: Sequence[Any], group: Any = None,
               async_op: bool = False) -> Any:
    """Rank ``j`` sends ``input_tensor_list[i]`` to rank ``i``; **returns** the received list
    (torch's ``all_to_all(output_tensor_list, input_tensor_list)`` fills the first list:
    here ``output_tensor_list = jaxpg.all_to_all(input_tensor_list)``).

    Chunks may differ in dim 0 per pair (eager). In a process holding several ranks, each
    list entry stacks those ranks' chunks along a leading axis (same shapes), or pass a list
    of per-rank lists for uneven chunks.
    """
    api = "all_to_all"
    pg, ctx = resolve(group, api)
    if isinstance(input_tensor_list, (list, tuple)):
        for i, x in enumerate(input_tensor_list):
            for j, y in enumerate(x if isinstance(x, (list, tuple)) else [x]):
                where = f"[{i}][{j}]" if isinstance(x, (list, tuple)) else f"[{i}]"
                check_input(y, api, f"input_tensor_list{where}")
    k = pg.size()
    if not isinstance(input_tensor_list, (list, tuple)):
        raise TypeError(f"{api}: input_tensor_list must be a list of {k} arrays; got "
                        f"{type(input_tensor_list).__name__}.")
    if ctx is not None:
        if len(input_tensor_list) != k:
            raise ValueError(f"{api}: input_tensor_list has {len(input_tensor_list)} arrays; "
                             f"the group has {k} ranks.")
        shapes = {jnp.shape(x) for x in input_tensor_list}
        if len(shapes) > 1:
            raise ValueError(f"{api}: in SPMD code every chunk must have the same shape; got "
                             f"{sorted(shapes)}.")
        out = ctx.lowering(pg).all_to_all(jnp.stack([jnp.asarray(x) for x in input_tensor_list]))
        return completed([out[i] for i in range(k)], async_op, api)
    n_local = local_count(pg, api)
    nested = n_local > 1 and all(isinstance(x, (list, tuple)) for x in input_tensor_list)
    if nested:
        rows = [[jnp.asarray(c) for c in row] for row in input_tensor_list]
    elif n_local == 1:
        rows = [[jnp.asarray(c) for c in input_tensor_list]]
    else:
        rows = [[jnp.asarray(c)[li] for c in input_tensor_list] for li in range(n_local)]
    if len(rows) != n_local or any(len(r) != k for r in rows):
        raise ValueError(f"{api}: need {k} chunks for each of this process's {n_local} ranks; "
                         f"got {[len(r) for r in rows]}.")
    for row in rows:
        if len({(c.shape[1:], c.dtype) for c in row}) > 1:
            raise ValueError(f"{api}: chunks may differ in dim 0 only; got "
                             f"{[(c.shape, str(c.dtype)) for c in row]}.")
    received = _exchange(pg, rows, api)
    if n_local == 1:
        return completed(received[0], async_op, api)
    if nested or len({tuple(c.shape) for row in received for c in row}) > 1:
        return completed(received, async_op, api)
    return completed([jnp.stack([received[li][i] for li in range(n_local)])
                      for i in range(k)], async_op, api)


@warns_if_discarded
@returns_work_at_once
def all_to_all_single(input: Any, output_split_sizes: Sequence[int] | None = None,  # noqa: A002
                      input_split_sizes: Sequence[int] | None = None, group: Any = None,
                      async_op: bool = False) -> Any:
    """Splits ``input`` along dim 0 by ``input_split_sizes`` (even if None), sends split ``i``
    to rank ``i``, and **returns** the concatenation of what arrives (torch writes it into
    its first argument, ``output``).

    ``output_split_sizes`` is optional (jaxpg learns the sizes); when given it is checked.
    In a process holding several ranks, ``input`` is a list of per-rank arrays and the
    split sizes are lists of per-rank lists (or one list for all).
    """
    api = "all_to_all_single"
    if _is_data(output_split_sizes) and not _is_sizes(output_split_sizes):
        raise torch_form_error(api)  # torch's (output, input, ...): an array in the sizes' place
    pg, ctx = resolve(group, api)
    check_inputs(input, api, "input")
    k = pg.size()
    if ctx is not None:
        x = jnp.asarray(input)
        if input_split_sizes is not None or output_split_sizes is not None:
            raise ValueError(f"{api}: SPMD code needs even splits (shapes are static); pass "
                             "no split sizes, or call it eagerly.")
        if x.shape[0] % k:
            raise ValueError(f"{api}: input's dim 0 ({x.shape[0]}) must divide by the group "
                             f"size {k} for even splits.")
        out = ctx.lowering(pg).all_to_all(x.reshape((k, -1, *x.shape[1:])))
        return completed(out.reshape(x.shape), async_op, api)
    n_local = local_count(pg, api)
    # Even splits (no split sizes): every rank passes the same shape, as torch requires, so
    # the SPMD lowering runs as one kernel, across processes too.
    if (input_split_sizes is None and output_split_sizes is None
            and not isinstance(input, (list, tuple))
            and all(len(sub) == k for sub in pg.family)):
        shape = np.shape(input)
        dims = shape if n_local == 1 else shape[1:]
        if dims and dims[0] % k == 0 and (n_local == 1 or shape[0] == n_local):
            # even splits and every rank's data here: the SPMD lowering, in one kernel
            def body(lay: Any, x: Any) -> Any:
                rows = x.reshape((k, x.shape[0] // k, *x.shape[1:]))
                return lay.all_to_all(rows).reshape(x.shape)

            return completed(run_eager(pg, api, "even", body, {"x": input}), async_op, api)
    inputs = [jnp.asarray(input)] if n_local == 1 else (
        [jnp.asarray(a) for a in input] if isinstance(input, (list, tuple))
        else [jnp.asarray(input)[i] for i in range(n_local)])

    def per_rank(spec: Any, li: int, arg: str, dim0: int | None) -> list[int] | None:
        if spec is None:
            return None
        row = spec[li] if spec and isinstance(spec[0], (list, tuple)) else spec
        row = [int(s) for s in row]
        if len(row) != k or min(row) < 0:
            raise ValueError(f"{api}: {arg}={list(spec)} needs {k} non-negative sizes.")
        if dim0 is not None and sum(row) != dim0:
            raise ValueError(f"{api}: {arg}={row} sums to {sum(row)}, but input's dim 0 is "
                             f"{dim0}.")
        return row

    rows = []
    for li, x in enumerate(inputs):
        splits = per_rank(input_split_sizes, li, "input_split_sizes", x.shape[0])
        if splits is None:
            if x.shape[0] % k:
                raise ValueError(f"{api}: input's dim 0 ({x.shape[0]}) must divide by the "
                                 f"group size {k}, or pass input_split_sizes.")
            splits = [x.shape[0] // k] * k
        bounds = np.cumsum([0] + splits)
        rows.append([x[bounds[i]:bounds[i + 1]] for i in range(k)])
    received = _exchange(pg, rows, api)
    outs = []
    for li, row in enumerate(received):
        want = per_rank(output_split_sizes, li, "output_split_sizes", None)
        got = [c.shape[0] for c in row]
        if want is not None and want != got:
            raise ValueError(f"{api}: output_split_sizes={want} does not match what the "
                             f"ranks sent, {got}.")
        outs.append(jnp.concatenate(row))
    if n_local == 1:
        return completed(outs[0], async_op, api)
    if len({o.shape for o in outs}) == 1:
        return completed(jnp.stack(outs), async_op, api)
    return completed(outs, async_op, api)
