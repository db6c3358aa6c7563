"""``moe``: a mixture-of-experts layer's forward over an expert-parallel group.

One rank's view: ``x`` its tokens, ``gate_w`` the router (the same on every rank), ``w1``
and ``w2`` its experts (rank ``r`` holds experts ``r·E_local … (r+1)·E_local − 1``). Inside
``jaxpg.spmd`` or ``shard_map`` the collectives lower to ``lax`` ones and the function
composes with ``jax.jit`` and ``jax.grad``; from host code it runs eagerly on this
process's ranks (stacked when it holds several), after checking that every rank's shapes
agree.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpg.collectives.eager import run_eager
from jaxpg.collectives.gathers import exchange_sizes
from jaxpg.collectives.reductions import all_reduce
from jaxpg.expert_parallel.checks import check_buffer_factor, check_moe_args
from jaxpg.expert_parallel.dispatch import (
    combine,
    dispatch,
    dispatch_rows,
    exchange,
    expert_ffn,
    first_try_rows,
    keep_mask,
    kept_counts,
    received_counts,
    received_rows,
    slot_counts,
)
from jaxpg.expert_parallel.grouped_matmul import check_grouped_matmul
from jaxpg.expert_parallel.router import route
from jaxpg.groups import world as _world
from jaxpg.groups.mesh_axis import resolve_mesh_axis
from jaxpg.groups.process_group import ProcessGroup
from jaxpg.spmd_lowering import SpmdContext, current_context
from jaxpg.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    scatter_to_tensor_parallel_region,
)

__all__ = ["MoEAux", "moe", "expert_capacity"]


class MoEAux(NamedTuple):
    """What ``moe`` reports besides its output (the same on every rank of the group).

    Attributes:
        loss: Switch's load-balancing loss ``E · Σ_e f_e · p_e`` over the group's tokens:
            ``f_e`` the share of the choices (all ``top_k`` of each token, before drops)
            that went to expert ``e``, ``p_e`` the mean router probability of ``e``. It is
            1 for a perfectly balanced router, whatever ``top_k``.
        counts: ``(E,)`` int32 choices per expert over the group's tokens, before drops.
        dropped: int32 choices dropped for capacity (0 when dropless).
    """

    loss: jax.Array
    counts: jax.Array
    dropped: jax.Array


def expert_capacity(capacity_factor: float | None, tokens: int, top_k: int,
                    num_experts: int) -> int | None:
    """``ceil(capacity_factor · tokens · top_k / E)``: the most choices one expert takes
    (``tokens`` over the whole group); None when dropless."""
    if capacity_factor is None:
        return None
    return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


def _moe_per_rank(x: jax.Array, gate_w: jax.Array, w1: jax.Array, w2: jax.Array, *,
                  group: Any, ep: int, top_k: int, capacity_factor: float | None,
                  activation: Callable[[jax.Array], jax.Array],
                  normalize_topk: bool, grouped_matmul: str,
                  replicated_tokens: bool = False,
                  buffer_factor: float | None = None) -> tuple[jax.Array, MoEAux]:
    tokens, _, num_experts, local = check_moe_args(x, gate_w, w1, w2, ep, top_k,
                                                   capacity_factor,
                                                   replicated_tokens=replicated_tokens)
    axis = None
    if replicated_tokens and group is not None:
        # a tensor-parallel region: every rank holds the same tokens; each routes its share,
        # and Megatron's region operators give the gradients tensor parallelism's rule
        axis = _group_axis(group)
        x = scatter_to_tensor_parallel_region(x, axis, dim=0)
        gate_w = copy_to_tensor_parallel_region(gate_w, axis)
        tokens //= ep
    global_tokens = tokens * ep
    capacity = expert_capacity(capacity_factor, global_tokens, top_k, num_experts)
    routing = route(x, gate_w, top_k, normalize_topk)
    counts = slot_counts(routing.experts, num_experts, group)  # (ep, k, E): counts first
    rank = _group_rank(group)
    keep = keep_mask(routing.experts, counts, rank, capacity)
    rows_per_rank = tokens * min(top_k, local)
    if capacity is not None:
        rows_per_rank = min(rows_per_rank, local * capacity)
    x_rows = jnp.repeat(x, top_k, axis=0)  # choice t·k + j carries token t
    kept = kept_counts(counts, capacity)  # (ep, E): what every rank sends every expert
    from_source = received_counts(kept, rank)  # so the counts need no exchange of their own

    first = None if group is None else first_try_rows(tokens, top_k, ep, rows_per_rank,
                                                      buffer_factor)
    if first is None:
        row, _ = dispatch_rows(routing.experts, keep, num_experts, ep, rows_per_rank)
        out = exchange(x_rows, row, from_source, w1, w2, activation, group, ep, rows_per_rank,
                       grouped_matmul)
    else:
        out = _first_try_exchange(x_rows, routing.experts, keep, kept, from_source, w1, w2,
                                  activation=activation, group=group, ep=ep,
                                  worst=rows_per_rank, first=first, impl=grouped_matmul)
    weights = routing.weights * keep.astype(routing.weights.dtype)
    y = jnp.einsum("tk,tkd->td", weights, out.reshape(tokens, top_k, -1)).astype(x.dtype)
    expert_counts = jnp.sum(counts, axis=(0, 1))
    prob_sum = jnp.sum(routing.probs, axis=0)
    if axis is not None:  # the same loss on every rank: its gradient is not summed again
        prob_sum = reduce_from_tensor_parallel_region(prob_sum, axis)
    elif group is not None:
        prob_sum = all_reduce(prob_sum, group=group)
    share = expert_counts.astype(jnp.float32) / (global_tokens * top_k)
    loss = num_experts * jnp.sum(share * prob_sum / global_tokens)
    dropped = (jnp.int32(0) if capacity is None
               else jnp.sum(jnp.maximum(expert_counts - capacity, 0)).astype(jnp.int32))
    if axis is not None:
        y = gather_from_tensor_parallel_region(y, axis, dim=0)
    return y, MoEAux(loss, expert_counts.astype(jnp.int32), dropped)


def _first_try_exchange(x_rows: jax.Array, experts: jax.Array, keep: jax.Array,
                        kept: jax.Array, from_source: jax.Array, w1: jax.Array, w2: jax.Array,
                        *, activation: Callable[[jax.Array], jax.Array], group: Any, ep: int,
                        worst: int, first: int, impl: str) -> jax.Array:
    """The exchange at ``first`` rows per pair when every pair's kept choices fit, else at
    the worst case ``worst``.

    Every rank takes the same branch: the predicate is from the gathered counts. Only the
    two all_to_alls (and the scatters and gathers around them, linear in the rows) are in
    the ``lax.cond``s, with their indices computed outside, so the branches keep no
    residuals and nothing is recomputed in the backward. The experts run once, outside,
    on a buffer of the worst case's rows: the grouped matmul's cost follows the rows the
    experts got, not the buffer.
    """
    num_experts = kept.shape[1]
    local = num_experts // ep
    fits = jnp.max(kept.reshape(ep, ep, local).sum(axis=-1)) <= first
    grouped_size = ep * worst
    plans = []
    for rows in (first, worst):
        row, _ = dispatch_rows(experts, keep, num_experts, ep, rows)
        grouped_row, group_sizes = received_rows(from_source, rows)
        plans.append((rows, row, grouped_row))

    def dispatch_at(plan: tuple[Any, ...]) -> Callable[..., jax.Array]:
        rows, row, grouped_row = plan
        return lambda x: dispatch(x, row, grouped_row, group, ep, rows, grouped_size)

    def combine_at(plan: tuple[Any, ...]) -> Callable[..., jax.Array]:
        rows, row, grouped_row = plan
        return lambda out: combine(out, row, grouped_row, group, ep, rows)

    grouped = lax.cond(fits, dispatch_at(plans[0]), dispatch_at(plans[1]), x_rows)
    out = expert_ffn(grouped, w1, w2, group_sizes, activation, impl)
    return lax.cond(fits, combine_at(plans[0]), combine_at(plans[1]), out)


def _global_view(x: Any, gate_w: Any, w1: Any) -> bool:
    """Whether traced code (``jax.jit``, ``jax.eval_shape``) outside SPMD code passes the
    layer's global arrays: ``x`` ``(tokens, d)`` and every expert, ``w1`` ``(E, d, f)``."""
    return (any(isinstance(a, jax.core.Tracer) for a in (x, gate_w, w1))
            and np.ndim(x) == 2 and np.ndim(gate_w) == 2 and np.ndim(w1) == 3
            and np.shape(w1)[0] == np.shape(gate_w)[1])


def _group_rank(group: Any) -> Any:
    """This rank's index in ``group`` inside SPMD code (traced; 0 without a group), from
    the running SPMD code's lowering, so a plain ``shard_map`` over a larger mesh gets it
    too."""
    if group is None:
        return 0
    ctx = current_context()
    return _world.get_rank(group) if ctx is None else ctx.lowering(group).member_index()


def _group_axis(group: Any) -> str:
    """The mesh axis the SPMD code binds for ``group`` (one mesh dimension)."""
    axes = current_context().lowering(group).native_axes
    if axes is None or len(axes) != 1:
        raise ValueError(f"moe: replicated_tokens=True needs the expert-parallel group to be "
                         f"one axis of the mesh the code runs over; {group!r} is not.")
    return axes[0]


def _binds_axis(ep_group: Any, api: str) -> bool:
    """Whether traced code binds the group's mesh axis (``shard_map`` without jaxpg.spmd)."""
    try:
        size = lax.axis_size(ep_group.axis)
    except NameError:
        return False
    if size != ep_group.size:
        raise ValueError(f"{api}: the running SPMD code binds axis {ep_group.axis!r} with size "
                         f"{size}, but the expert-parallel group has {ep_group.size} ranks.")
    return True


def _bound(ep_group: Any) -> tuple[Any, Any]:
    """The mesh that traced code binds, and the group to run over it: the group's whole mesh
    and the group, or, where only the group's axis is bound (a ``shard_map`` over the
    group's own devices, as a pipeline stage's programs are), the 1-D mesh of this process's
    group's devices and that group alone (without its siblings on the other rows)."""
    mesh, pg = ep_group.mesh, ep_group.group
    for name in mesh.axis_names:
        try:
            lax.axis_size(name)
        except NameError:
            return jax.sharding.Mesh(np.asarray(pg.devices), (ep_group.axis,)), _row_group(pg)
    return mesh, pg


@functools.lru_cache(maxsize=64)
def _row_group(pg: Any) -> Any:
    """``pg``'s own ranks as a group of their own (named after ``pg``: no new group name is
    drawn, so every process keeps the same sequence of group names)."""
    return ProcessGroup(pg._world, pg.ranks, name=f"{pg.group_name}.row", timeout=pg.timeout)


def _check_same_on_every_rank(pg: Any, shapes: list[tuple[int, ...]], api: str) -> None:
    """Host code across processes: every rank's argument shapes must agree."""
    flat = np.array([[len(s) for s in shapes] + [v for s in shapes for v in s]], np.int32)
    n_local = len(pg.local_members())
    every = exchange_sizes(pg, np.repeat(flat, n_local, axis=0), api)
    if len({tuple(r) for r in every.tolist()}) > 1:
        names = ("x", "gate_w", "w1", "w2")
        raise ValueError(f"{api}: the ranks of the expert-parallel group passed different "
                         f"shapes of (x, gate_w, w1, w2) (rank {_world.get_rank()} has "
                         f"{dict(zip(names, shapes))}); every rank must hold the same number "
                         "of tokens and experts of the same shapes.")


def moe(x: Any, gate_w: Any, w1: Any, w2: Any, *, group: Any = None, top_k: int = 2,
        capacity_factor: float | None = None,
        activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
        normalize_topk: bool = True, grouped_matmul: str = "auto",
        replicated_tokens: bool = False,
        buffer_factor: float | None = 1.25) -> tuple[jax.Array, MoEAux]:
    """A mixture-of-experts layer with its experts split over ``group`` (expert parallelism).

    Each token picks its ``top_k`` experts by ``logits = x @ gate_w``; ``y = Σ weight ·
    expert(x)`` with ``expert(x) = activation(x @ w1[e]) @ w2[e]``. The tokens travel to the
    experts' ranks by ``all_to_all_single`` after the per-expert counts are exchanged, the
    experts run a grouped matmul on exactly the tokens they got, and the results come back
    by the inverse ``all_to_all_single``.

    Args:
        x: ``(tokens_local, d)`` this rank's tokens.
        gate_w: ``(d, E)`` the router, the same on every rank.
        w1: ``(E_local, d, f)`` this rank's experts' first weights, ``E = E_local · ep``.
        w2: ``(E_local, f, d)`` their second weights.
        group: the expert-parallel group (``mesh["ep"]``, a ProcessGroup, None: the world).
        top_k: experts per token.
        capacity_factor: None: dropless. Else each expert takes at most
            ``ceil(capacity_factor · tokens · top_k / E)`` choices (``tokens`` of the whole
            group), first choices before second ones, then in rank and token order; the
            rest are dropped (their contribution is zero) and counted in ``aux.dropped``.
        activation: the experts' activation. A gated one that halves the width (SwiGLU
            on ``[gate | up]`` rows, as ``jaxpg.models``' Qwen3-MoE) takes ``w1``
            ``(E_local, d, 2f)`` and ``w2`` ``(E_local, f, d)``.
        normalize_topk: True: the weights are the softmax over the chosen logits (Mixtral);
            False: the full softmax's probabilities of the chosen experts (GShard, Switch).
        grouped_matmul: the experts' grouped matmul: ``"auto"`` (a tiled loop over the
            routed rows on CPU, jax's Mosaic kernels on Hopper GPUs for 16-bit weights,
            else ``jax.lax.ragged_dot``), or one of ``"tiled"``, ``"mosaic"``, ``"xla"``
            (:mod:`jaxpg.expert_parallel.grouped_matmul`).
        replicated_tokens: ``x`` is the same on every rank of the group, as inside a
            tensor-parallel region (a stage of a tensor-parallel pipeline whose model
            axis is the group): each rank routes its ``1/ep`` share of the tokens (which
            must divide), and ``y`` is gathered back whole on every rank. Gradients follow
            tensor parallelism's rule: ``x``'s and ``gate_w``'s are whole on every rank, each
            expert's is its own.
        buffer_factor: the exchange first tries buffers of ``buffer_factor`` times the
            balanced load per pair of ranks (``tokens_local · top_k / ep`` rows) instead of
            the worst case; when a step's routing sends more to some rank (every rank knows
            it from the exchanged counts), that step's exchange runs at the worst-case size.
            The result is the same either way; None always uses the worst case.

    Returns:
        ``(y, aux)``: ``y`` ``(tokens_local, d)``, and an :class:`MoEAux`.

    Raises:
        ValueError, TypeError: before anything runs, for E not divisible by ep, top_k
            outside ``[1, E]``, ``gate_w`` of the wrong width, expert shapes that do not
            match (or differ across ranks), a group that is not one mesh dimension.

    Example:
        >>> g = jaxpg.init_device_mesh((4,), ("ep",))["ep"]
        >>> y, aux = jaxpg.spmd(lambda *a: moe(*a, group=g), group=g)(x, gate_w, w1, w2)
    """
    api = "moe"
    check_grouped_matmul(grouped_matmul, api)
    ep_group = resolve_mesh_axis(group, "ep", api=api)
    pg, ep = ep_group.group, ep_group.size
    check_buffer_factor(buffer_factor, api)
    options = dict(group=pg, ep=ep, top_k=top_k, capacity_factor=capacity_factor,
                   activation=activation, normalize_topk=normalize_topk,
                   grouped_matmul=grouped_matmul, replicated_tokens=replicated_tokens,
                   buffer_factor=buffer_factor)
    if current_context() is not None:
        return _moe_per_rank(x, gate_w, w1, w2, **options)
    if _binds_axis(ep_group, api):  # a plain jax.shard_map over the group's mesh
        mesh, bound = _bound(ep_group)
        with SpmdContext(mesh, _world.current()):
            return _moe_per_rank(x, gate_w, w1, w2, **{**options, "group": bound})
    if ep == 1 or _global_view(x, gate_w, w1):
        # no communication: plain code on these arrays (ep = 1, or traced global arrays
        # holding every expert, which XLA partitions as they are laid out)
        return _moe_per_rank(x, gate_w, w1, w2, **{**options, "group": None, "ep": 1,
                                                   "replicated_tokens": False})
    # Host code: this process's ranks' arguments (stacked when it holds several).
    n_local = len(pg.local_members())
    per_rank = [np.shape(a)[1:] if n_local > 1 else np.shape(a) for a in (x, gate_w, w1, w2)]
    if pg._world.multiprocess:  # first, so that every rank takes part before any raises
        _check_same_on_every_rank(pg, [tuple(s) for s in per_rank], api)
    check_moe_args(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in per_rank), ep, top_k,
                   capacity_factor, api, replicated_tokens)

    def body(lay: Any, x: Any, gate_w: Any, w1: Any, w2: Any) -> Any:
        return _moe_per_rank(x, gate_w, w1, w2, **options)

    static = (top_k, capacity_factor, activation, normalize_topk, grouped_matmul,
              replicated_tokens, buffer_factor)
    return run_eager(pg, api, static, body, {"x": x, "gate_w": gate_w, "w1": w1, "w2": w2})
