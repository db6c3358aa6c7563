"""The pipeline executor: one jitted SPMD loop that runs a timetable on a mesh.

``pipeline_value_and_grad`` computes the mean loss over all microbatches and its
gradient, with the model cut into ``S = p * v`` stages over the mesh's pipeline axis
(``p`` ranks, ``v`` chunks per rank). The work is a ``shard_map`` over the mesh whose
body is one ``lax.scan`` over the ticks of the timetable, so compile time does not grow
with the number of microbatches ``m``.

Model and parameters:
    * ``stage_fn(stage_params, x) -> y``, the repeated block; every stage maps an
      activation (any pytree of arrays) to one of the same shapes and dtypes.
    * Stage parameters are stacked with leading dimension ``S``, by default in **model
      order** (stage ``s`` runs on rank ``s % p`` as chunk ``s // p``; in the V layout
      chunk 1 of rank ``r`` is stage ``2p - 1 - r``). Inside, they are viewed as
      ``[v, p, ...]`` and sharded ``P(None, 'pp')``. With ``v == 1`` a ``P('pp')``
      placement of the ``[p, ...]`` stack is exact; with ``v > 1`` XLA reshards a
      model-order stack on every call, and ``stage_order="rank"`` (a stack made by
      ``to_rank_order``, placed ``P('pp')``) avoids that (``jaxpg.pipeline.stage_order``).
    * ``first_fn(first_params, inputs_mb) -> x`` (optional embedding) runs on stage 0;
      ``loss_fn(last_params, y, targets_mb) -> scalar`` (head + loss, the mean over the
      microbatch) runs on stage ``S - 1``. Their parameters are replicated over the
      pipeline axis; only the rank that uses them gets a nonzero gradient, which is then
      ``psum``-ed over ``'pp'`` so every rank holds the same gradient.

Per tick, each rank reads one row of the ``BufferPlan`` (branch, microbatch, chunk,
slots) by ``lax.axis_index('pp')`` and runs its action as one of three two-way
``lax.cond``s in a row (``jaxpg.pipeline.tick_program``; the other two pass the state
through):

    * ``F``: reads the stage input from the activation buffer (stage 0 embeds the
      microbatch and stores the result there), applies the stage and sends the output
      to rank ``r + 1`` (ring; rank ``p - 1``'s chunk ``c`` feeds rank 0's chunk
      ``c + 1``). The last stage applies head + loss at once and stores ``d(loss / m)``
      in the gradient buffer.
    * ``B``: by default (``remat=False``) runs the backward from the residuals the
      forward saved (``jaxpg.pipeline.stage_split``), adds the weight gradient to the
      chunk's accumulator and sends the input gradient on. With ``split_backward``
      (ZB-H1, ZB-V) ``B`` computes only the input gradient and saves what ``W`` needs,
      and ``W`` only the weight gradient: no recomputation. With ``remat=True``
      (stage-input remat) only the stage input is kept and ``B`` recomputes the stage
      with ``jax.vjp`` (``W`` once more).

A stage's parameter-only layout work (``w[i]`` of a stack of layers: slices, squeezes,
transposes) is hoisted out of the loop (``jaxpg.pipeline.stage_hoist``): the loop runs
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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpg.data_parallel.step_cache import code_keyed
from jaxpg.groups.resolve import data_parallel_axis, resolve_mesh
from jaxpg.pipeline import buffer_plan as cols
from jaxpg.pipeline.buffer_plan import BufferPlan, plan_buffers
from jaxpg.pipeline.microbatch import split_microbatches
from jaxpg.pipeline.pipeline_config import PipelineConfig, PipelineExecutor
from jaxpg.pipeline.stage_hoist import hoist_stage
from jaxpg.pipeline.stage_meta import batch_stage_metadata
from jaxpg.pipeline.stage_order import check_stage_order, loop_view, stacked
from jaxpg.pipeline.stage_split import split_stage
from jaxpg.pipeline.staged_params import StagedParams
from jaxpg.pipeline.tick_program import KIND_OF, slot_buffers, tick_steps, write_slot
from jaxpg.supervision.step_recording import recorded_step

__all__ = [
    "EXECUTORS",
    "StagedParams",
    "check_param_specs",
    "pipeline_value_and_grad",
    "resolve_schedule",
]


def resolve_schedule(schedule: Any, num_ranks: int, num_microbatches: int | None, v: int):
    """Returns the timetable for ``schedule`` (a name or a ``Timetable``), checked."""
    if isinstance(schedule, str):
        if num_microbatches is None:
            raise ValueError(
                f"num_microbatches is required when schedule is a name ({schedule!r})."
            )
        from jaxpg.pipeline.schedules import get_schedule

        return get_schedule(schedule, num_ranks, num_microbatches, v)
    if not hasattr(schedule, "grid"):
        raise TypeError(
            f"schedule must be a schedule name or a Timetable, got {type(schedule).__name__}."
        )
    checks = {"num_stages": num_ranks, "num_chunks": v}
    if num_microbatches is not None:
        checks["num_microbatches"] = num_microbatches
    for field, want in checks.items():
        if getattr(schedule, field) != want:
            raise ValueError(
                f"Timetable {schedule.name!r} has {field}={getattr(schedule, field)}, but "
                f"the mesh and parameters need {field}={want}."
            )
    return schedule


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
    if cfg.dp_axis is not None:
        loss = lax.pmean(loss, cfg.dp_axis)
        reducer = cfg.grad_reducer or functools.partial(lax.pmean, axis_name=cfg.dp_axis)
        grads = reducer(grads)
    elif cfg.grad_reducer is not None:
        grads = cfg.grad_reducer(grads)
    grads = grads._replace(stages=jax.tree.map(lambda a: a[:, None], grads.stages))
    return loss, grads


def _run(cfg: PipelineConfig, plan: BufferPlan, params: StagedParams, inputs, targets):
    tt = cfg.timetable
    metas, _ = batch_stage_metadata(cfg, params, inputs, targets)
    stages = jax.tree.map(lambda a: loop_view(a, tt, cfg.stage_order), params.stages)
    batch_spec = P(cfg.dp_axis) if cfg.dp_axis is not None else P()
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


def check_param_specs(param_specs: Any, params: StagedParams, mesh: Mesh, pp_axis: str,
                      dp_axis: str | None) -> tuple | None:
    """``param_specs`` as a hashable ``(leaves, treedef)``, checked against ``params``.

    ``param_specs`` is a ``StagedParams`` of ``PartitionSpec`` trees shaped as the
    parameters: for ``stages`` the spec of *one* stage's arrays (the stage dimension is
    the pipeline's), for ``first`` and ``last`` the arrays' own; a bare tree is taken as
    the stages' specs. Specs name mesh axes other than the pipeline and data-parallel ones
    (a tensor-parallel axis).
    """
    if param_specs is None:
        return None
    if not isinstance(param_specs, StagedParams):
        param_specs = StagedParams(param_specs, jax.tree.map(lambda _: P(), params.first),
                                   jax.tree.map(lambda _: P(), params.last))
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    leaves, treedef = jax.tree.flatten(param_specs, is_leaf=is_spec)
    want = jax.tree.structure(params)
    if treedef != want or not all(map(is_spec, leaves)):
        raise ValueError(
            "param_specs must be a StagedParams of PartitionSpecs with the parameters' "
            f"structure ({want}); build it with jaxpg.tensor_parallel.param_specs(state)."
        )
    for spec in leaves:
        for entry in spec:
            for axis in (entry if isinstance(entry, tuple) else (entry,)) if entry else ():
                if axis not in mesh.axis_names or axis in (pp_axis, dp_axis):
                    raise ValueError(
                        f"param_specs: {spec} names mesh axis {axis!r}; a parameter may be "
                        f"split over the mesh's other axes ({mesh.axis_names} less "
                        f"{pp_axis!r} and {dp_axis!r}), such as the tensor-parallel one."
                    )
    return tuple(leaves), treedef


@functools.lru_cache(maxsize=64)
def _compiled(cfg: PipelineConfig):
    # called from host code, a launch is a recorded collective call on the mesh's group
    return recorded_step(jax.jit(functools.partial(_run, cfg, plan_buffers(cfg.timetable))),
                         cfg.mesh, name="pipeline_value_and_grad")


def run_spmd(cfg: PipelineConfig, params: StagedParams, inputs: Any,
             targets: Any) -> tuple[jax.Array, StagedParams]:
    """The lockstep executor (a :class:`~jaxpg.pipeline.pipeline_config.PipelineExecutor`):
    one jitted program over the mesh, compiled once per config."""
    return _compiled(cfg)(params, inputs, targets)


EXECUTORS = ("auto", "spmd", "mpmd")


def _use_mpmd(executor: Any, mesh: Mesh, args: Any, pp_axis: str, dp_axis: str | None,
              param_specs: Any) -> bool:
    """Whether the process executor runs this call (see ``executor`` in the docstring)."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor={executor!r} is not one of {EXECUTORS}.")
    if executor == "spmd":
        return False
    from jaxpg.pipeline.process_executor import mpmd_unsupported_reason

    traced = any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(args))
    reason = mpmd_unsupported_reason(mesh, pp_axis, dp_axis, param_specs)
    if executor == "auto":
        return not traced and reason is None
    if traced:
        raise ValueError(
            "executor='mpmd' runs each action from host code and cannot be traced: call "
            "pipeline_value_and_grad outside jax.jit (or use executor='spmd')."
        )
    if reason is not None:
        raise ValueError(f"executor='mpmd' cannot run on this mesh: {reason}. Use "
                         "executor='spmd' (or 'auto').")
    return True


def pipeline_value_and_grad(
    stage_fn: Callable[[Any, Any], Any],
    loss_fn: Callable[[Any, Any, Any], Any],
    params: StagedParams | Any,
    inputs: Any,
    targets: Any,
    *,
    mesh: Any,
    schedule: Any = "1f1b",
    num_microbatches: int | None = None,
    first_fn: Callable[[Any, Any], Any] | None = None,
    pp_axis: str = "pp",
    dp_axis: str = "dp",
    grad_reducer: Callable[[Any], Any] | None = None,
    remat: bool = False,
    stage_order: str = "model",
    executor: str = "auto",
    param_specs: Any = None,
) -> tuple[jax.Array, Any]:
    """Mean loss over the batch and its gradient, computed by a pipeline schedule.

    Args:
        stage_fn: ``stage_fn(stage_params, x) -> y``, the repeated block.
        loss_fn: ``loss_fn(last_params, y, targets_mb) -> scalar``: head + mean loss of
            one microbatch.
        params: a ``StagedParams``, or only the stage-stacked parameters (leading
            dimension ``p * v`` in model order; then ``first_fn`` and the head take ``()``).
        inputs: a pytree of arrays with the (global) batch as dimension 0.
        targets: a pytree of arrays with the same batch dimension.
        mesh: a mesh with axis ``pp_axis`` and optionally ``dp_axis``: a
            ``jax.sharding.Mesh``, a ``jaxpg.init_device_mesh(...)`` DeviceMesh, a
            ``jaxpg.ParallelDims`` (its ``pp`` axis, and ``dp_replicate`` or ``dp_shard`` as
            ``dp_axis``) or a ``jaxpg.HybridCommunicateGroup`` (its ``dp``/``pp``
            dimensions; a model-parallel ``mp`` dimension is left to the model).
        schedule: a schedule name (``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``,
            ``"zb_h1"``) or a ``Timetable``.
        num_microbatches: ``m``; required with a schedule name.
        first_fn: optional ``first_fn(first_params, inputs_mb) -> x`` on stage 0.
        pp_axis: the mesh axis of the pipeline.
        dp_axis: the data-parallel mesh axis, used if the mesh has it.
        grad_reducer: reduces each rank's gradients (a ``StagedParams`` of its local
            stage gradients ``[v, ...]`` and the replicated first/last gradients) over the
            data-parallel axis; default ``pmean`` over ``dp_axis``. Without a ``dp_axis``
            it is applied as given (default: none). A reducer whose output is split over
            ``dp`` (ZeRO-2, ``jaxpg.pipeline.zero``) carries a ``grad_spec`` attribute: a
            ``StagedParams`` of ``PartitionSpec`` trees for its output, stage leaves in
            the loop's ``[v, p, ...]`` view.
        remat: ``False`` (default) keeps each microbatch's vjp residuals from its
            forward until its backward, so no forward runs twice (and a split backward's
            ``B`` and ``W`` together do the work of one backward); ``True`` keeps only the
            stage inputs and recomputes the stage forward in the backward (and again in
            ``W``): less memory, more work.
        stage_order: ``"model"`` or ``"rank"``, the order of the stage stacks in
            ``params`` (``jaxpg.pipeline.stage_order``).
        executor: ``"spmd"``: one program over the mesh, all ranks in lockstep (this
            module); ``"mpmd"``: the process executor, one pipeline rank per process, each
            running its own actions with point-to-point transfers
            (``jaxpg.pipeline.process_executor``), from host code only; ``"auto"`` (default):
            ``"mpmd"`` when called outside ``jax.jit`` on a mesh whose devices are each in
            a process of their own, else ``"spmd"``. Both give the same loss and
            gradients.
        param_specs: for parameters split over another mesh axis (tensor parallelism on a
            HybridCommunicateGroup's ``mp``): a ``StagedParams`` of ``PartitionSpec`` trees
            with the parameters' structure, one stage's specs for ``stages`` (see
            ``check_param_specs``). Inside, each stage sees its local shards. None:
            everything replicated but the stage dimension.

    Returns:
        ``(loss, grads)``: the mean loss, and gradients of the same structure as ``params``.

    Raises:
        ValueError: on a mesh without ``pp_axis``, a stage count that is not a multiple
            of the pipeline size, a batch not divisible by ``dp * m``, stage shapes that
            do not chain, or a timetable that does not fit.
    """
    dp_axis = data_parallel_axis(mesh, dp_axis)
    mesh = resolve_mesh(mesh, api="pipeline_value_and_grad")
    if pp_axis not in mesh.axis_names:
        raise ValueError(
            f"mesh has axes {mesh.axis_names} but no pipeline axis {pp_axis!r}; build it "
            "as jaxpg.ParallelDims(pp=...) or pass pp_axis=."
        )
    staged = params if isinstance(params, StagedParams) else StagedParams(params)
    p = mesh.shape[pp_axis]
    counts = {jnp.shape(a)[0] if jnp.ndim(a) else 0 for a in jax.tree.leaves(staged.stages)}
    if len(counts) != 1 or 0 in counts or next(iter(counts)) % p:
        raise ValueError(
            f"Stage parameters must be stacked with a leading dimension of p * v stages, a "
            f"multiple of the pipeline size p={p}; got leading dimensions {sorted(counts)}."
        )
    v = next(iter(counts)) // p
    timetable = resolve_schedule(schedule, p, num_microbatches, v)
    dp = dp_axis if dp_axis in mesh.axis_names else None
    if not isinstance(remat, bool):
        raise TypeError(f"remat={remat!r} must be True or False.")
    # functions keyed by code and closure: a fresh lambda each call reuses the compiled step
    cfg = PipelineConfig(
        code_keyed(stage_fn), code_keyed(loss_fn), code_keyed(first_fn), mesh, timetable,
        pp_axis, dp, code_keyed(grad_reducer), remat,
        check_stage_order(stage_order),
        check_param_specs(param_specs, staged, mesh, pp_axis, dp),
    )
    run: PipelineExecutor = run_spmd
    if _use_mpmd(executor, mesh, (staged, inputs, targets), pp_axis, dp, param_specs):
        from jaxpg.pipeline.process_executor import run_mpmd

        run = run_mpmd
    loss, grads = run(cfg, staged, inputs, targets)
    return loss, grads if isinstance(params, StagedParams) else grads.stages
