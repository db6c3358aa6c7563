"""Placing DDP state on a group's mesh, and checking that every rank holds the same model.

What torch's ``DistributedDataParallel.__init__`` does before training, in JAX terms:

- :func:`split_model` separates an NNX module's parameters from the rest of its state
  (a Linen parameter pytree is all parameters).
- :func:`verify_param_shapes` is ``_verify_param_shape_across_processes``: every rank's
  *signature* (path, shape and dtype of each parameter) must be the same; the error names
  the first parameter that differs and the ranks that disagree.
- :func:`replicate_from_rank0` is ``_sync_module_states`` (``broadcast_params=True``): the
  group's rank 0's values become a replicated array ``NamedSharding(pg.mesh, P())``.
- :func:`shard_batch` and :func:`per_rank` lay out data with a leading axis split over the
  group (``P(pg.axis_name)``): the batch (this process's part of the global batch) and
  per-rank state such as a communication hook's error buffers.

Every helper takes this process's *local* data and short-circuits the one-process case
(all of the group's ranks live here) to a plain ``jax.device_put``; with one rank per
process (under ``jaxpg-run``) it goes through ``jax.make_array_from_process_local_data``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.data_parallel.batch_placement import place_batch
from jaxpg.data_parallel.prng_keys import unkey

__all__ = [
    "split_model",
    "ParamSignature",
    "param_signature",
    "verify_param_shapes",
    "gather_param_signatures",
    "replicate_from_rank0",
    "shard_batch",
    "per_rank",
    "all_local",
]

ParamSignature = tuple[tuple[str, tuple[int, ...], str], ...]


def split_model(module: Any) -> tuple[Any, Any, Any]:
    """``(graphdef, params, rest)`` of an NNX module; ``(None, params, None)`` for a pytree."""
    from flax import linen, nnx

    if isinstance(module, nnx.Module):
        return nnx.split(module, nnx.Param, ...)
    if isinstance(module, linen.Module):
        raise TypeError(
            "DistributedDataParallel: for a Linen module pass its parameters "
            "(variables['params']) and a loss_fn(params, batch) that calls module.apply; "
            f"got the module {type(module).__name__} itself."
        )
    leaves = jax.tree.leaves(module)
    if not leaves or not all(hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves):
        raise TypeError(
            "DistributedDataParallel: module must be an nnx.Module or a non-empty pytree of "
            f"parameter arrays (Linen's variables['params']); got {type(module).__name__}."
        )
    return None, module, None


def all_local(pg: Any) -> bool:
    """Whether this process holds every rank of ``pg`` (the one-process case)."""
    return len(pg.local_members()) == pg.size()


def param_signature(params: Any) -> ParamSignature:
    """``(path, shape, dtype)`` of every leaf of ``params``, in flatten order."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return tuple(
        (jax.tree_util.keystr(path), tuple(int(d) for d in leaf.shape), str(leaf.dtype))
        for path, leaf in leaves
    )


def verify_param_shapes(signatures: list[ParamSignature], ranks: list[int] | None = None) -> None:
    """Checks that every rank's parameter signature equals rank 0's.

    Args:
        signatures: one :func:`param_signature` per rank of the group, in group-rank order.
        ranks: the global rank of each entry (default ``0..len-1``), used in the error.

    Raises:
        ValueError: naming the first parameter whose shape or dtype differs (or the first
            missing one) and the ranks that disagree with rank 0.
    """
    ranks = list(range(len(signatures))) if ranks is None else list(ranks)
    if len(ranks) != len(signatures):
        raise ValueError(f"verify_param_shapes: {len(signatures)} signatures for {ranks=}.")
    if not signatures:
        return
    ref = signatures[0]
    for i in range(max(len(s) for s in signatures)):
        want = ref[i] if i < len(ref) else None
        bad = [r for r, s in zip(ranks, signatures, strict=True)
               if (s[i] if i < len(s) else None) != want]
        if not bad:
            continue
        first_bad = signatures[ranks.index(bad[0])]
        got = first_bad[i] if i < len(first_bad) else None
        name = (want or got)[0]
        describe = (lambda e: "no such parameter" if e is None
                    else f"shape {e[1]} dtype {e[2]} at {e[0]}")
        raise ValueError(
            f"DistributedDataParallel: parameter {i} ({name}) differs across ranks: rank "
            f"{ranks[0]} has {describe(want)}, rank(s) {bad} have {describe(got)}. Every rank "
            "must build the same model (same layer sizes and dtypes) before wrapping it."
        )


def gather_param_signatures(params: Any, pg: Any) -> list[ParamSignature]:
    """Every rank's :func:`param_signature` of ``params``, in group-rank order.

    In one process every rank shares this process's model, so the list repeats it; across
    processes it is an ``all_gather_object`` over ``pg``.
    """
    sig = param_signature(params)
    if all_local(pg):
        return [sig] * pg.size()
    from jaxpg.collectives import all_gather_object

    gathered = all_gather_object([list(map(list, sig))], group=pg)
    return [tuple((p, tuple(s), d) for p, s, d in g[0]) for g in gathered]


def replicate_from_rank0(tree: Any, pg: Any, *, broadcast: bool = True) -> Any:
    """Returns ``tree`` as fresh arrays replicated over ``pg.mesh``, with rank 0's values.

    In one process every rank holds this process's values, so this is a copy onto the
    mesh. Across processes each process passes its own values; with ``broadcast`` the
    group's rank 0's values win (torch's ``broadcast_params``), else each process's
    values are taken as already equal.
    """
    sharding = NamedSharding(pg.mesh, P())
    if all_local(pg):
        # A fresh copy first: device_put may alias a buffer already on a mesh device, and
        # the train step donates its inputs.
        return jax.tree.map(lambda x: jax.device_put(jnp.array(x, copy=True), sharding), tree)
    raw, rekey = unkey(tree)
    if not broadcast:
        return rekey(jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), raw))
    stacked = NamedSharding(pg.mesh, P(pg.axis_name))
    here = set(pg._world.local_ranks)
    n_local = sum(r in here for r in pg.ranks)  # one row per rank of the group held here
    local = jax.tree.map(lambda x: jax.make_array_from_process_local_data(
        stacked, np.repeat(np.asarray(x)[None], n_local, axis=0)), raw)
    return rekey(_rank0_kernel(pg)(local))


def _rank0_kernel(pg: Any) -> Any:
    axis = pg.axis_name

    def body(local):
        first = jax.lax.axis_index(axis) == 0
        return jax.tree.map(
            lambda x: jax.lax.psum(jnp.where(first, x[0], jnp.zeros_like(x[0])), axis), local)

    return jax.jit(jax.shard_map(body, mesh=pg.mesh, in_specs=P(axis), out_specs=P(),
                                 check_vma=False))


def shard_batch(batch: Any, pg: Any) -> Any:
    """Lays out this process's part of the global batch over ``pg``: ``P(axis)`` on dim 0.

    Args:
        batch: a pytree of arrays whose leading dimension is this process's samples; it
            must divide evenly among this process's ranks of ``pg``.
        pg: the DDP group.

    Raises:
        ValueError: if a leaf has no leading dimension or it does not divide evenly.
    """
    return place_batch(batch, NamedSharding(pg.mesh, P(pg.axis_name)),
                       len(pg.local_members()), all_local(pg),
                       "rank(s) of the DDP group. Drop or pad the last batch, e.g. "
                       "DistributedSampler(..., drop_last=True) or a batch size that is a "
                       "multiple of the rank count.")


def per_rank(tree: Any, pg: Any) -> Any:
    """Stacks one copy of ``tree`` per local rank and lays it out ``P(axis)`` over ``pg``.

    The result has a leading rank axis of the group's size; rank ``i`` owns row ``i``.
    Used for per-rank state (a hook's error buffers, a no_sync accumulator).
    """
    n_local = len(pg.local_members())
    sharding = NamedSharding(pg.mesh, P(pg.axis_name))

    def place(x):
        stacked = jnp.broadcast_to(jnp.asarray(x)[None], (n_local, *np.shape(x)))
        if all_local(pg):
            return jax.device_put(jnp.array(stacked, copy=True), sharding)
        return jax.make_array_from_process_local_data(sharding, np.asarray(stacked))

    return jax.tree.map(place, tree)
