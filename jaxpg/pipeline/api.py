"""The functional entry point: ``pipeline_value_and_grad``, resolved into one
:class:`~jaxpg.pipeline.stage.config.PipelineConfig` and run by one of two executors.

* ``executor="spmd"``: the lockstep executor (:mod:`jaxpg.pipeline.lockstep.executor`),
  one jitted program over the mesh;
* ``executor="mpmd"``: the process executor (:mod:`jaxpg.pipeline.process.executor`), one
  pipeline rank per process, each running its own actions from host code;
* ``executor="auto"`` picks between them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpg.data_parallel.step_cache import code_keyed
from jaxpg.groups.resolve import data_parallel_axis, resolve_mesh
from jaxpg.pipeline.lockstep.executor import run_spmd
from jaxpg.pipeline.stage.config import PipelineConfig, PipelineExecutor
from jaxpg.pipeline.stage.order import check_stage_order
from jaxpg.pipeline.stage.params import StagedParams

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
        from jaxpg.pipeline.schedule.builders import get_schedule

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


def check_param_specs(param_specs: Any, params: StagedParams, mesh: Mesh, pp_axis: str,
                      dp_axis: str | None) -> tuple | None:
    """``param_specs`` as a hashable ``(leaves, treedef)``, checked against ``params``.

    ``param_specs`` is a ``StagedParams`` of ``PartitionSpec`` trees shaped as the
    parameters: for ``stages`` the spec of *one* stage's arrays (the stage dimension is
    the pipeline's), for ``first`` and ``last`` the arrays' own; a bare tree is taken as
    the stages' specs. Specs name mesh axes other than the pipeline one: a tensor-parallel
    axis, or the data-parallel one (``dp_axis``) for parameters each data-parallel rank holds
    a part of (experts routed over it, fully sharded parameters).
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
                if axis not in mesh.axis_names or axis == pp_axis:
                    raise ValueError(
                        f"param_specs: {spec} names mesh axis {axis!r}; a parameter may be "
                        f"split over the mesh's axes other than the pipeline's "
                        f"({mesh.axis_names} less {pp_axis!r}), such as the tensor-parallel "
                        "or the data-parallel one."
                    )
    return tuple(leaves), treedef


EXECUTORS = ("auto", "spmd", "mpmd")


def _check_cp_axis(cp_axis: Any, mesh: Mesh, pp_axis: str, dp_axis: str | None) -> None:
    if cp_axis is None:
        return
    if cp_axis not in mesh.axis_names or cp_axis in (pp_axis, dp_axis):
        raise ValueError(f"cp_axis={cp_axis!r} must name a mesh axis other than the pipeline's "
                         f"({pp_axis!r}) and the data-parallel one ({dp_axis!r}); the mesh has "
                         f"axes {mesh.axis_names}.")


def _use_mpmd(executor: Any, mesh: Mesh, args: Any, pp_axis: str, dp_axis: str | None,
              param_specs: Any) -> bool:
    """Whether the process executor runs this call (see ``executor`` in the docstring)."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor={executor!r} is not one of {EXECUTORS}.")
    if executor == "spmd":
        return False
    from jaxpg.pipeline.process.executor import mpmd_unsupported_reason

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
    cp_axis: str | None = None,
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
            ``params`` (``jaxpg.pipeline.stage.order``).
        executor: ``"spmd"``: one program over the mesh, all ranks in lockstep
            (``jaxpg.pipeline.lockstep.executor``); ``"mpmd"``: the process executor, one
            pipeline rank per process, each running its own actions with point-to-point
            transfers (``jaxpg.pipeline.process.executor``), from host code only;
            ``"auto"`` (default): ``"mpmd"`` when called outside ``jax.jit`` on a mesh whose
            devices are each in a process of their own, else ``"spmd"``. Both give the same
            loss and gradients.
        param_specs: for parameters split over another mesh axis (tensor parallelism on a
            HybridCommunicateGroup's ``mp``): a ``StagedParams`` of ``PartitionSpec`` trees
            with the parameters' structure, one stage's specs for ``stages`` (see
            ``check_param_specs``). Inside, each stage sees its local shards. A spec may
            name ``dp_axis`` too: experts split over the data-parallel ranks, each routing
            its own rows to them (``jaxpg.expert_parallel.moe(..., group=mesh[dp_axis])``),
            or parameters ``stage_fn`` gathers itself (fully sharded); the default reducer
            then divides such a gradient by the data-parallel size instead of averaging it
            (the collectives' transposes already summed every rank's rows into it). None:
            everything replicated but the stage dimension.
        cp_axis: a context-parallel mesh axis (``"cp"``; None: none): the inputs and
            targets are split along their sequence dimension (1) over it, each rank running
            every stage on its part of every sequence, its attention over the axis
            (``ContextParallelAttention(group=mesh["cp"], method="all_gather")`` or
            ``"all_to_all"``: a ``ppermute`` in a stage, as ring attention's, is refused,
            see docs/pipeline.md), positions from
            ``jaxpg.context_parallel.local_positions``); the loss is the mean over the parts
            and each gradient follows ``dp_axis``' rule over it. Lockstep executor only.

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
    _check_cp_axis(cp_axis, mesh, pp_axis, dp)
    if not isinstance(remat, bool):
        raise TypeError(f"remat={remat!r} must be True or False.")
    # functions keyed by code and closure: a fresh lambda each call reuses the compiled step
    cfg = PipelineConfig(
        code_keyed(stage_fn), code_keyed(loss_fn), code_keyed(first_fn), mesh, timetable,
        pp_axis, dp, code_keyed(grad_reducer), remat,
        check_stage_order(stage_order),
        check_param_specs(param_specs, staged, mesh, pp_axis, dp), cp_axis,
    )
    run: PipelineExecutor = run_spmd
    if _use_mpmd(executor, mesh, (staged, inputs, targets), pp_axis, dp, param_specs):
        from jaxpg.pipeline.process.executor import run_mpmd

        run = run_mpmd
    loss, grads = run(cfg, staged, inputs, targets)
    return loss, grads if isinstance(params, StagedParams) else grads.stages
