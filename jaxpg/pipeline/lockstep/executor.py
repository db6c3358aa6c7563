"""The lockstep executor (``executor="spmd"``): one jitted SPMD loop that runs a timetable
on a mesh.

``pipeline_value_and_grad`` (:mod:`jaxpg.pipeline.api`) computes the mean loss over all
microbatches and its gradient, with the model cut into ``S = p * v`` stages over the mesh's
pipeline axis (``p`` ranks, ``v`` chunks per rank). The work is a ``shard_map`` over the
mesh whose body is one ``lax.scan`` over the ticks of the timetable, so compile time does
not grow with the number of microbatches ``m``.

Model and parameters:
    * ``stage_fn(stage_params, x) -> y``, the repeated block; every stage maps an
      activation (any pytree of arrays) to one of the same shapes and dtypes.
    * Stage parameters are stacked with leading dimension ``S``, by default in **model
      order** (stage ``s`` runs on rank ``s % p`` as chunk ``s // p``; in the V layout
      chunk 1 of rank ``r`` is stage ``2p - 1 - r``). Inside, they are viewed as
      ``[v, p, ...]`` and sharded ``P(None, 'pp')``. With ``v == 1`` a ``P('pp')``
      placement of the ``[p, ...]`` stack is exact; with ``v > 1`` XLA reshards a
      model-order stack on every call, and ``stage_order="rank"`` (a stack made by
      ``to_rank_order``, placed ``P('pp')``) avoids that (``jaxpg.pipeline.stage.order``).
    * ``first_fn(first_params, inputs_mb) -> x`` (optional embedding) runs on stage 0;
      ``loss_fn(last_params, y, targets_mb) -> scalar`` (head + loss, the mean over the
      microbatch) runs on stage ``S - 1``. Their parameters are replicated over the
      pipeline axis; only the rank that uses them gets a nonzero gradient, which is then
      ``psum``-ed over ``'pp'`` so every rank holds the same gradient.

Per tick, each rank reads one row of the ``BufferPlan`` (branch, microbatch, chunk,
slots) by ``lax.axis_index('pp')`` and runs its action as one of three two-way
``lax.cond``s in a row (``jaxpg.pipeline.lockstep.tick_program``; the other two pass the state
through):

    * ``F``: reads the stage input from the activation buffer (stage 0 embeds the
      microbatch and stores the result there), applies the stage and sends the output
      to rank ``r + 1`` (ring; rank ``p - 1``'s chunk ``c`` feeds rank 0's chunk
      ``c + 1``). The last stage applies head + loss at once and stores ``d(loss / m)``
      in the gradient buffer.
    * ``B``: by default (``remat=False``) runs the backward from the residuals the
      forward saved (``jaxpg.pipeline.stage.split``), adds the weight gradient to the
      chunk's accumulator and sends the input gradient on. With ``split_backward``
      (ZB-H1, ZB-V) ``B`` computes only the input gradient and saves what ``W`` needs,
      and ``W`` only the weight gradient: no recomputation. With ``remat=True``
      (stage-input remat) only the stage input is kept and ``B`` recomputes the stage
      with ``jax.vjp`` (``W`` once more).

A stage's parameter-only layout work (``w[i]`` of a stack of layers: slices, squeezes,
transposes) is hoisted out of the loop (``jaxpg.pipeline.stage.hoist``): the loop runs
the stage on the prepared per-layer arrays and accumulates their gradients, which are
turned back into gradients of the stack once, after the loop (less work than leaving
it to XLA; docs/pipeline_mp.md, "How it works").

Slot buffers and accumulators are the conds' state and are updated in place; no
``lax.switch`` carries them (XLA copies every output of a conditional with more than two
branches on every tick; see ``tick_program``).

After the conds, the one message of the tick (an activation or a gradient) goes to
rank ``r + 1`` and ``r - 1`` by two ring ``ppermute``s (one when no message ever travels
one of the ways); at the start of the next tick each rank stores what it received into
the slot the plan names (the turn of a V layout stays on the rank). Storing it there,
before any step reads the buffers, rather than at the end of the tick lets XLA update
the slot buffers in place: stored after the conds, the store could be scheduled before
``W`` read the buffers, and XLA copied both buffers every tick to keep the old values.
The ``ppermute``s run on every tick (a rank with nothing to send sends zeros), as SPMD
collectives must. Stage inputs, output gradients and (without remat) residuals are kept
in buffers of exactly the size the schedule needs (1F1B: about ``p`` slots, independent of ``m``).

With a data-parallel axis (``'dp'`` in the mesh), the batch is sharded over it; each
replica splits its part into ``m`` microbatches, and ``grad_reducer`` (default:
``pmean`` over ``'dp'``) reduces each rank's gradients before they leave the loop.

Limits, by design:
    * Every pipeline rank of a data-parallel replica holds that replica's inputs and
      targets (replicated over ``'pp'``), though only the first stage reads inputs and
      only the last reads targets.
    * All repeated stages share one activation structure; change widths in
      ``first_fn`` or the head.
    * Compiled programs are cached per (functions, mesh, timetable, axes, reducer):
      pass the same function objects on every call, or call from inside ``jax.jit``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpg.data_parallel.leaf_split import spec_axes
from jaxpg.pipeline.lockstep import buffer_plan as cols
from jaxpg.pipeline.lockstep.buffer_plan import BufferPlan, plan_buffers
from jaxpg.pipeline.lockstep.tick_program import KIND_OF, slot_buffers, tick_steps, write_slot
from jaxpg.pipeline.stage.config import PipelineConfig
from jaxpg.pipeline.stage.hoist import hoist_stage
from jaxpg.pipeline.stage.metadata import batch_stage_metadata
from jaxpg.pipeline.stage.microbatch import split_microbatches
from jaxpg.pipeline.stage.order import loop_view, stacked
from jaxpg.pipeline.stage.params import StagedParams
from jaxpg.pipeline.stage.split import split_stage
from jaxpg.pipeline.stage.trace_tools import bound_axes
from jaxpg.supervision.step_recording import recorded_step

__all__ = ["data_parallel_mean", "run_spmd"]


def _body(cfg: PipelineConfig, plan: BufferPlan, act_struct, params, inputs, targets):
    """Runs on one (dp, pp) rank inside ``shard_map``."""
    p = cfg.mesh.shape[cfg.pp_axis]
    m = cfg.timetable.num_microbatches
    rank = lax.axis_index(cfg.pp_axis)
    stages = jax.tree.map(lambda a: a[:, 0], params.stages)  # [v, ...] on this rank
    first_p, last_p = params.first, params.last
    inputs = split_microbatches(inputs, m)
    targets = split_microbatches(targets, m)
    one_stage = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stages)
    _refuse_permutes(cfg, one_stage, act_struct, (first_p, last_p), inputs, targets)
    stage_fn, hoisted = cfg.stage_fn, hoist_stage(cfg.stage_fn, one_stage, act_struct)
    if hoisted is not None:  # the stage's parameter layout work, once (stage_hoist)
        stage_fn, stages = hoisted.stage, jax.vmap(hoisted.prepare)(stages)
        one_stage = hoisted.q_structs
    pieces = None
    if not cfg.remat:  # a split backward only where the timetable has W actions
        pieces = split_stage(stage_fn, one_stage, act_struct, "W" in plan.branches)
    steps = tick_steps(
        stage_fn, cfg.loss_fn, cfg.first_fn, m, plan.branches,
        (stages, first_p, last_p), inputs, targets, pieces,
    )  # fmt: skip

    remat = pieces is None
    names = plan.branches
    state = {
        "act": slot_buffers(act_struct, plan.num_act_slots),
        "grad": slot_buffers(act_struct, plan.num_grad_slots),
        "res": () if remat else slot_buffers(pieces.res_structs, plan.num_act_slots),
        "wres": slot_buffers(pieces.wres_structs, plan.num_grad_slots)
        if not remat and "W" in names else (),
        # One accumulator per chunk, each without a chunk dimension (see tick_program).
        "g_stages": [jax.tree.map(lambda a, i=i: jnp.zeros_like(a[i]), stages)
                     for i in range(cfg.timetable.num_chunks)],
        "g_first": jax.tree.map(jnp.zeros_like, first_p),
        "last": (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, last_p)),
        "message": jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), act_struct),
    }
    # Per branch number: the action kind, and whether it runs the first / last stage.
    kind_of = jnp.asarray([KIND_OF[n] for n in names], dtype=jnp.int32)
    first_of = jnp.asarray([n.endswith("_first") or "_first_" in n for n in names])
    last_of = jnp.asarray([n.endswith("_last") for n in names])
    kinds = [(1, steps.forward), (2, steps.backward)] + (
        [(3, steps.weight)] if "W" in names else []
    )
    ways = [  # (permutation or None for the V turn, act column, grad column), as used
        (perm, act_col, grad_col)
        for perm, act_col, grad_col in (
            ([(i, (i + 1) % p) for i in range(p)], cols.UP_ACT, cols.UP_GRAD),
            ([(i, (i - 1) % p) for i in range(p)], cols.DOWN_ACT, cols.DOWN_GRAD),
            (None, cols.LOCAL_ACT, cols.LOCAL_GRAD),
        )
        if plan.uses(act_col) or plan.uses(grad_col)
    ]
    # What the last tick received, and its plan row (which slots to store it in). The
    # store happens at the start of the next tick, before any step reads the buffers:
    # stored at the end of a tick, after the conds, XLA copies both slot buffers every
    # tick to keep the old values for a step it may schedule after the store (W).
    state["inbox"] = [state["message"] for _ in ways]
    state["inbox_op"] = jnp.full((plan.table.shape[-1],), -1, jnp.int32)

    def tick(state, row):
        op = lax.dynamic_index_in_dim(row, rank, 0, keepdims=False)
        state = {**state, **receive(state)}
        branch = op[cols.BRANCH]
        flags = (first_of[branch], last_of[branch])
        for kind, step in kinds:  # two-way conds only: see tick_program
            written = {k: state[k] for k in step.writes}
            read = {k: x for k, x in state.items() if k not in step.writes}
            written = lax.cond(
                kind_of[branch] == kind,
                lambda w, r, op, fl, step=step: step.run({**r, **w}, op, fl),
                lambda w, *_: w,
                written, read, op, flags,
            )  # fmt: skip
            state = {**state, **written}
        message = state["message"]
        state["inbox"] = [
            message if perm is None else lax.ppermute(message, cfg.pp_axis, perm)
            for perm, _, _ in ways
        ]
        state["inbox_op"] = op
        return state, None

    def receive(state):
        """Stores what the last tick received into the slots its plan row names."""
        bufs = {"act": state["act"], "grad": state["grad"]}
        op = state["inbox_op"]
        for got, (_, act_col, grad_col) in zip(state["inbox"], ways, strict=True):
            for key, col in (("act", act_col), ("grad", grad_col)):
                if plan.uses(col):
                    bufs[key] = write_slot(bufs[key], op[col], got)
        return bufs

    # The last tick's inbox is never stored: no tick is left to read it.
    acc, _ = lax.scan(tick, state, jnp.asarray(plan.table))
    loss_acc, g_last = acc["last"]
    loss = lax.psum(loss_acc, cfg.pp_axis)
    g_stages = acc["g_stages"]
    if hoisted is not None:
        g_stages = [hoisted.grad_back(g) for g in g_stages]
    grads = StagedParams(
        jax.tree.map(lambda *g: jnp.stack(g), *g_stages),
        lax.psum(acc["g_first"], cfg.pp_axis),
        lax.psum(g_last, cfg.pp_axis),
    )
    if cfg.data_axes:
        loss = lax.pmean(loss, cfg.data_axes)
        grads = (cfg.grad_reducer or data_parallel_mean(cfg))(grads)
    elif cfg.grad_reducer is not None:
        grads = cfg.grad_reducer(grads)
    grads = grads._replace(stages=jax.tree.map(lambda a: a[:, None], grads.stages))
    return loss, grads


def _struct(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _float_sum(tree: Any) -> jax.Array:
    return sum((jnp.sum(a.astype(jnp.float32)) for a in jax.tree.leaves(tree)
                if jnp.issubdtype(a.dtype, jnp.inexact)), jnp.zeros((), jnp.float32))


def _refuse_permutes(cfg: PipelineConfig, one_stage: Any, act_struct: Any, ends: tuple,
                     inputs: Any, targets: Any) -> None:
    """Raises if a stage function, forward or backward, binds ``ppermute`` over an axis
    other than pp. Each pipeline rank runs its stages inside its own ``lax.cond``s, at its
    own ticks; one ``ppermute`` spans the whole mesh, and XLA pairs the ranks that run it at
    different ticks: the values come out wrong (ring attention did, on CPU)."""
    x_mb, y_mb = (_struct(jax.tree.map(lambda a: a[0], t)) for t in (inputs, targets))
    first_p, last_p = (_struct(t) for t in ends)
    checks = [("stage_fn", cfg.stage_fn, (one_stage, act_struct)),
              ("loss_fn", cfg.loss_fn, (last_p, act_struct, y_mb))]
    if cfg.first_fn is not None:
        checks.append(("first_fn", cfg.first_fn, (first_p, x_mb)))
    for name, fn, args in checks:
        grad = jax.grad(lambda *a, fn=fn: _float_sum(fn(*a)))
        jaxpr = jax.make_jaxpr(grad)(*args)
        axes = sorted(bound_axes(jaxpr, "ppermute") - {cfg.pp_axis})
        if axes:
            raise ValueError(
                f"{name} binds lax.ppermute over mesh axis {axes[0]!r} (ring attention: "
                "ContextParallelAttention(method='ring')). The lockstep executor runs each "
                "pipeline rank's stages in its own conds at its own ticks, where XLA would "
                "pair that collective across ranks at different ticks and give wrong values. "
                "Use a collective over groups instead (ContextParallelAttention("
                "method='all_gather' or 'all_to_all')), or run the stages as PipelineStages "
                "(context_parallel_group=), whose programs run whole on their sub-mesh.")


def data_parallel_mean(cfg: PipelineConfig) -> Any:
    """The default ``grad_reducer`` over ``cfg.data_axes`` (the data-parallel and
    context-parallel axes, inside the loop's ``shard_map``): per axis, the mean over its
    ranks of each replicated parameter's gradient; a gradient split over the axis (its spec
    in ``cfg.param_specs`` names it: experts the ranks route their rows to, fully sharded
    parameters) divided by the axis' size, as the collectives' transposes summed every
    rank's contribution into its part (torch FSDP's averaging reduce-scatter)."""
    axes = cfg.data_axes
    if cfg.param_specs is None:
        return functools.partial(lax.pmean, axis_name=axes)
    owned = [spec_axes(spec) & set(axes) for spec in cfg.param_specs[0]]

    def one(g: Any, own: set) -> Any:
        rest = tuple(a for a in axes if a not in own)
        g = lax.pmean(g, rest) if rest else g
        for a in own:
            g = g / lax.axis_size(a)
        return g

    def reduce(grads: StagedParams) -> StagedParams:
        leaves, treedef = jax.tree.flatten(grads)
        return jax.tree.unflatten(treedef, [one(g, own)
                                            for g, own in zip(leaves, owned, strict=True)])

    return reduce


def _run(cfg: PipelineConfig, plan: BufferPlan, params: StagedParams, inputs, targets):
    tt = cfg.timetable
    metas, _ = batch_stage_metadata(cfg, params, inputs, targets)
    stages = jax.tree.map(lambda a: loop_view(a, tt, cfg.stage_order), params.stages)
    batch_spec = P(cfg.dp_axis, cfg.cp_axis) if cfg.cp_axis is not None else (
        P(cfg.dp_axis) if cfg.dp_axis is not None else P())
    param_spec = _param_spec(cfg)
    # a reducer that reduce-scatters over dp (ZeRO-2, jaxpg.pipeline.zero) says how
    # its output is laid out, in this [v, p, ...] view
    grad_spec = getattr(cfg.grad_reducer, "grad_spec", None) or param_spec
    body = functools.partial(_body, cfg, plan, metas[0].input)
    loss, grads = jax.shard_map(
        body,
        mesh=cfg.mesh,
        in_specs=(param_spec, batch_spec, batch_spec),
        out_specs=(P(), grad_spec),
        check_vma=False,
    )(params._replace(stages=stages), inputs, targets)
    return loss, grads._replace(
        stages=jax.tree.map(lambda a: stacked(a, tt, cfg.stage_order), grads.stages))


def _param_spec(cfg: PipelineConfig) -> StagedParams:
    """The executor's in/out specs of the parameters: stages ``P(None, pp, *spec)``."""
    if cfg.param_specs is None:
        return StagedParams(P(None, cfg.pp_axis), P(), P())
    specs = jax.tree.unflatten(cfg.param_specs[1], cfg.param_specs[0])
    return StagedParams(jax.tree.map(lambda s: P(None, cfg.pp_axis, *s), specs.stages),
                        specs.first, specs.last)


@functools.lru_cache(maxsize=64)
def _compiled(cfg: PipelineConfig):
    # called from host code, a launch is a recorded collective call on the mesh's group
    return recorded_step(jax.jit(functools.partial(_run, cfg, plan_buffers(cfg.timetable))),
                         cfg.mesh, name="pipeline_value_and_grad")


def run_spmd(cfg: PipelineConfig, params: StagedParams, inputs: Any,
             targets: Any) -> tuple[jax.Array, StagedParams]:
    """The lockstep executor (a :class:`~jaxpg.pipeline.stage.config.PipelineExecutor`):
    one jitted program over the mesh, compiled once per config."""
    return _compiled(cfg)(params, inputs, targets)
