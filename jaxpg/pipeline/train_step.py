"""A jitted optax training step around the pipeline executor.

Example (``block``, ``head_loss``, ``embed``, ``params`` as in ``pipeline_value_and_grad``)::

    mesh = jaxpg.ParallelDims(dp_replicate=2, pp=4)  # on 8 devices
    optimizer = optax.adam(1e-3)
    params, opt_state = init_train_state(params, optimizer, mesh)
    step = make_train_step(block, head_loss, optimizer, mesh=mesh, schedule="1f1b",
                           num_microbatches=8, first_fn=embed)
    params, opt_state, loss = step(params, opt_state, inputs, targets)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.groups.resolve import data_parallel_axis, resolve_mesh
from jaxpg.pipeline.api import (
    EXECUTORS,
    StagedParams,
    pipeline_value_and_grad,
)
from jaxpg.pipeline.fully_sharded import fully_sharded_specs, gathering
from jaxpg.pipeline.param_placement import place_pipeline_params, put_copy
from jaxpg.pipeline.process.executor import mpmd_unsupported_reason
from jaxpg.pipeline.stage.order import check_stage_order
from jaxpg.supervision.step_recording import recorded_step

__all__ = ["make_train_step", "init_train_state"]


def init_train_state(
    params: StagedParams | Any,
    optimizer: optax.GradientTransformation,
    mesh: Any,
    *,
    pp_axis: str = "pp",
    param_specs: Any = None,
    zero_stage: int = 0,
    dp_axis: str = "dp",
) -> tuple[Any, Any]:
    """Places ``params`` on ``mesh`` and builds the optimizer state next to them.

    Optimizer-state leaves that are not already laid out on the mesh (step counters
    and other scalars) are replicated over it, so the train step compiles once: its
    outputs then have the same placement as its inputs. With ``zero_stage`` 1 or 2 the
    optimizer state is split over ``dp_axis`` instead (ZeRO-1 and 2 store the same state),
    with 3 the parameters too, and the state with them
    (:mod:`jaxpg.pipeline.fully_sharded`). Pass the same ``zero_stage`` to
    :func:`make_train_step`.

    Returns:
        ``(placed_params, opt_state)``.
    """
    stage = _zero_stage(zero_stage, "init_train_state")
    if stage == 3:
        dp_axis = data_parallel_axis(mesh, dp_axis)
        _refuse_specs_with_zero3(param_specs, "init_train_state")
        param_specs = fully_sharded_specs(params, mesh, dp_axis)
    elif stage:
        from jaxpg.pipeline.zero import init_zero_train_state

        dp_axis = data_parallel_axis(mesh, dp_axis)

        if param_specs is not None:
            raise ValueError(
                f"init_train_state: zero_stage={zero_stage} with param_specs (tensor-parallel "
                "stages) is not supported inside a pipeline; drop one of them "
                "(make_train_step refuses the pair too).")

        return init_zero_train_state(params, optimizer, mesh, pp_axis=pp_axis,
                                     dp_axis=dp_axis)
    placed = place_pipeline_params(params, mesh, pp_axis=pp_axis, param_specs=param_specs)
    mesh = resolve_mesh(mesh, api="init_train_state")
    replicated = NamedSharding(mesh, P())

    def place(leaf):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
            return leaf
        return put_copy(leaf, replicated)

    return placed, jax.tree.map(place, optimizer.init(placed))


def make_train_step(
    stage_fn: Callable[[Any, Any], Any],
    loss_fn: Callable[[Any, Any, Any], Any],
    optimizer: optax.GradientTransformation,
    *,
    mesh: Any,
    schedule: Any = "1f1b",
    num_microbatches: int | None = None,
    first_fn: Callable[[Any, Any], Any] | None = None,
    pp_axis: str = "pp",
    dp_axis: str = "dp",
    grad_reducer: Callable[[Any], Any] | None = None,
    donate: bool = True,
    remat: bool = False,
    stage_order: str = "model",
    executor: str = "auto",
    param_specs: Any = None,
    zero_stage: int = 0,
    params: Any = None,
    cp_axis: str | None = None,
) -> Callable[[Any, Any, Any, Any], tuple[Any, Any, jax.Array]]:
    """Returns ``step(params, opt_state, inputs, targets) -> (params, opt_state, loss)``.

    The step computes the loss and gradients with ``pipeline_value_and_grad`` (same
    arguments) and applies ``optimizer``. With the SPMD executor the whole step is one
    ``jax.jit``; with the process executor (``executor="mpmd"``, or ``"auto"`` on a mesh
    whose devices are each in a process of their own) the gradients come from host code
    and the optimizer update is one jitted program over the placed parameters.

    Args:
        stage_fn: the repeated block, ``stage_fn(stage_params, x) -> y``.
        loss_fn: head + mean loss, ``loss_fn(last_params, y, targets_mb) -> scalar``.
        optimizer: an optax gradient transformation.
        mesh: a mesh with a pipeline axis: a ``ParallelDims`` (``pp`` and a
            data-parallel degree) or any other form ``pipeline_value_and_grad`` takes.
        schedule: schedule name or ``Timetable``.
        num_microbatches: ``m``.
        first_fn: optional embedding on stage 0.
        pp_axis: pipeline mesh axis.
        dp_axis: data-parallel mesh axis (used if the mesh has it).
        grad_reducer: reduces gradients over the data-parallel axis; default ``pmean``.
        donate: donate the parameter and optimizer-state buffers to the step.
        remat: ``False`` keeps vjp residuals from each forward to its backward; ``True``
            recomputes the stage forward from its input (see ``pipeline_value_and_grad``).
        stage_order: ``"model"`` or ``"rank"``: the order of the stage stacks in
            ``params`` (see ``pipeline_value_and_grad``). With two chunks per rank, keep
            parameters in rank order (``to_rank_order`` before ``init_train_state``): no
            step then moves them between devices.
        executor: ``"auto"``, ``"spmd"`` or ``"mpmd"`` (see ``pipeline_value_and_grad``).
        param_specs: how parameters are split over other mesh axes (tensor parallelism);
            see ``pipeline_value_and_grad``. Place them with the same ``param_specs``.
        zero_stage: 0 (replicated optimizer state), 1 (the optimizer state split over
            ``dp_axis``), 2 (and the gradients reduce-scattered over it instead of
            all-reduced) or 3 (and the parameters, all-gathered by each stage, embedding
            and head before it runs, per microbatch: :mod:`jaxpg.pipeline.fully_sharded`;
            on the lockstep executor); the state from ``init_train_state(...,
            zero_stage=)``.
        params: the parameters (placed, or their shapes), for ``zero_stage`` 1 to 3:
            the optimizer state's or the parameters' split is made from them.
        cp_axis: a context-parallel axis splitting every sequence (see
            ``pipeline_value_and_grad``); not with ``zero_stage`` 1 or 2.
    """
    dp_axis = data_parallel_axis(mesh, dp_axis)
    stage = _zero_stage(zero_stage, "make_train_step")
    if stage == 3:
        if params is None:
            raise ValueError("make_train_step: zero_stage=3 splits the parameters by their "
                             "shapes; pass params= (the placed parameters, or their shapes).")
        _refuse_specs_with_zero3(param_specs, "make_train_step")
        if executor == "mpmd":
            raise ValueError("make_train_step: zero_stage=3 runs on the lockstep executor "
                             "(one jitted step); pass executor='auto' or 'spmd', or fully "
                             "shard PipelineStages with fsdp_group= across processes.")
        param_specs = fully_sharded_specs(params, mesh, dp_axis)
        stage_fn = gathering(stage_fn, param_specs.stages, dp_axis)
        first_fn = gathering(first_fn, param_specs.first, dp_axis)
        loss_fn = gathering(loss_fn, param_specs.last, dp_axis)
    elif stage:
        if cp_axis is not None:
            raise ValueError(f"make_train_step: zero_stage={zero_stage} with cp_axis= is not "
                             "offered; use zero_stage=0 or 3 with context parallelism.")
        if params is None:
            raise ValueError(f"make_train_step: zero_stage={zero_stage} splits the optimizer "
                             "state by the parameters' shapes; pass params= (the placed "
                             "parameters, or their shapes).")
        if grad_reducer is not None:
            raise ValueError(f"make_train_step: zero_stage={zero_stage} reduces the "
                             "gradients itself; drop grad_reducer.")
        if executor == "mpmd":
            raise ValueError(f"make_train_step: zero_stage={zero_stage} runs on the lockstep "
                             "executor (one jitted step); pass executor='auto' or 'spmd'.")
        from jaxpg.pipeline.zero import make_zero_train_step

        return make_zero_train_step(
            stage_fn, loss_fn, optimizer, params, mesh=mesh, zero_stage=zero_stage,
            pp_axis=pp_axis, dp_axis=dp_axis, donate=donate, schedule=schedule,
            num_microbatches=num_microbatches, first_fn=first_fn, remat=remat,
            stage_order=stage_order, param_specs=param_specs)
    check_stage_order(stage_order)
    if not isinstance(remat, bool):
        raise TypeError(f"remat={remat!r} must be True or False.")
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"optimizer must be an optax.GradientTransformation, got {type(optimizer).__name__}."
        )

    if executor not in EXECUTORS:
        raise ValueError(f"executor={executor!r} is not one of {EXECUTORS}.")
    donated = (0, 1) if donate else ()

    def grads_of(params, inputs, targets, executor):
        return pipeline_value_and_grad(
            stage_fn, loss_fn, params, inputs, targets, mesh=mesh, schedule=schedule,
            num_microbatches=num_microbatches, first_fn=first_fn, pp_axis=pp_axis,
            dp_axis=dp_axis, grad_reducer=grad_reducer, remat=remat,
            stage_order=stage_order, executor=executor, param_specs=param_specs,
            cp_axis=cp_axis,
        )  # fmt: skip

    def update(params, opt_state, grads):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    mpmd = executor == "mpmd" or (
        executor == "auto" and mpmd_unsupported_reason(
            _jax_mesh(mesh), pp_axis, dp_axis, param_specs) is None)
    if mpmd:
        jitted_update = jax.jit(update, donate_argnums=donated)

        def host_step(params, opt_state, inputs, targets):
            loss, grads = grads_of(params, inputs, targets, executor)
            params, opt_state = jitted_update(params, opt_state, grads)
            return params, opt_state, loss

        return host_step

    def step(params, opt_state, inputs, targets):
        loss, grads = grads_of(params, inputs, targets, "spmd")
        return *update(params, opt_state, grads), loss

    # each launch is a recorded collective call on the mesh's group (docs/debugging.md)
    return recorded_step(jax.jit(step, donate_argnums=donated), _jax_mesh(mesh),
                         name="pipeline.train_step")


def _zero_stage(zero_stage: int, api: str) -> int:
    """``zero_stage`` checked: 0 to 3 inside a pipeline."""
    from jaxpg.data_parallel.zero import resolve_zero_stage

    return resolve_zero_stage(api, (0, 1, 2, 3), 0, zero_stage)


def _refuse_specs_with_zero3(param_specs: Any, api: str) -> None:
    if param_specs is not None:
        raise ValueError(f"{api}: zero_stage=3 splits every parameter over the data-parallel "
                         "axis itself and cannot also take param_specs (tensor-parallel "
                         "stages); drop one of them, or split the stages' parameters over "
                         "dp in param_specs yourself and gather them in stage_fn.")


def _jax_mesh(mesh: Any) -> Any:
    return resolve_mesh(mesh, api="pipeline.make_train_step")
