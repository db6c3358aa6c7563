"""A jitted optax training step around the pipeline executor.

Example (``block``, ``head_loss``, ``embed``, ``params`` as in ``pipeline_value_and_grad``)::

    mesh = pipeline_mesh(4)  # dp=2 x pp=4 on 8 devices
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
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.groups.recorded_step import recorded_step
from jaxpg.pipeline.executor import StagedParams, check_param_specs, pipeline_value_and_grad
from jaxpg.pipeline.stage_order import check_stage_order

__all__ = ["make_train_step", "place_pipeline_params", "init_train_state"]


def place_pipeline_params(params: StagedParams | Any, mesh: Mesh, *, pp_axis: str = "pp",
                          param_specs: Any = None) -> Any:
    """Puts stage-stacked parameters on ``mesh``: stages ``P(pp_axis)``, the rest replicated.

    With one chunk per rank each device then holds exactly its own stage; with more,
    so does a stack in rank order (``to_rank_order``; pass ``stage_order="rank"`` to the
    step), while a model-order one is resharded by every step. Optimizer
    states made from the placed parameters (``optimizer.init``) inherit the placement.
    The result is a copy, so a train step that donates it leaves ``params`` intact.
    With ``param_specs`` (see ``pipeline_value_and_grad``) each array is also split as its
    spec says: a stage array ``P(pp_axis, *spec)``, the others by their spec. ``mesh``
    may also be a DeviceMesh or a HybridCommunicateGroup.
    """
    mesh = getattr(getattr(mesh, "mesh", mesh), "jax_mesh", mesh)  # hcg / DeviceMesh
    staged = params if isinstance(params, StagedParams) else StagedParams(params)
    staged = jax.tree.map(lambda a: jnp.array(a, copy=True), staged)
    if param_specs is None:
        placed = StagedParams(
            jax.device_put(staged.stages, NamedSharding(mesh, P(pp_axis))),
            jax.device_put(staged.first, NamedSharding(mesh, P())),
            jax.device_put(staged.last, NamedSharding(mesh, P())),
        )
    else:
        leaves, treedef = check_param_specs(param_specs, staged, mesh, pp_axis, None)
        specs = jax.tree.unflatten(treedef, leaves)
        specs = specs._replace(stages=jax.tree.map(lambda s: P(pp_axis, *s), specs.stages))
        placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
                              staged, specs)
    return placed if isinstance(params, StagedParams) else placed.stages


def init_train_state(
    params: StagedParams | Any,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    pp_axis: str = "pp",
    param_specs: Any = None,
) -> tuple[Any, Any]:
    """Places ``params`` on ``mesh`` and builds the optimizer state next to them.

    Optimizer-state leaves that are not already laid out on the mesh (step counters
    and other scalars) are replicated over it, so the train step compiles once: its
    outputs then have the same placement as its inputs.

    Returns:
        ``(placed_params, opt_state)``.
    """
    placed = place_pipeline_params(params, mesh, pp_axis=pp_axis, param_specs=param_specs)
    mesh = getattr(getattr(mesh, "mesh", mesh), "jax_mesh", mesh)
    replicated = NamedSharding(mesh, P())

    def place(leaf):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
            return leaf
        return jax.device_put(leaf, replicated)

    return placed, jax.tree.map(place, optimizer.init(placed))


def make_train_step(
    stage_fn: Callable[[Any, Any], Any],
    loss_fn: Callable[[Any, Any, Any], Any],
    optimizer: optax.GradientTransformation,
    *,
    mesh: Mesh,
    schedule: Any = "1f1b",
    num_microbatches: int | None = None,
    first_fn: Callable[[Any, Any], Any] | None = None,
    pp_axis: str = "pp",
    dp_axis: str = "dp",
    grad_reducer: Callable[[Any], Any] | None = None,
    donate: bool = True,
    remat: bool = False,
    stage_order: str = "model",
    param_specs: Any = None,
) -> Callable[[Any, Any, Any, Any], tuple[Any, Any, jax.Array]]:
    """Returns ``step(params, opt_state, inputs, targets) -> (params, opt_state, loss)``.

    The step computes the loss and gradients with ``pipeline_value_and_grad`` (same
    arguments) and applies ``optimizer``; the whole step is one ``jax.jit``.

    Args:
        stage_fn: the repeated block, ``stage_fn(stage_params, x) -> y``.
        loss_fn: head + mean loss, ``loss_fn(last_params, y, targets_mb) -> scalar``.
        optimizer: an optax gradient transformation.
        mesh: the ``("dp", "pp")`` mesh (see ``pipeline_mesh``).
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
        param_specs: how parameters are split over other mesh axes (tensor parallelism);
            see ``pipeline_value_and_grad``. Place them with the same ``param_specs``.
    """
    check_stage_order(stage_order)
    if not isinstance(remat, bool):
        raise TypeError(f"remat={remat!r} must be True or False.")
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"optimizer must be an optax.GradientTransformation, got {type(optimizer).__name__}."
        )

    def step(params, opt_state, inputs, targets):
        loss, grads = pipeline_value_and_grad(
            stage_fn, loss_fn, params, inputs, targets, mesh=mesh, schedule=schedule,
            num_microbatches=num_microbatches, first_fn=first_fn, pp_axis=pp_axis,
            dp_axis=dp_axis, grad_reducer=grad_reducer, remat=remat,
            stage_order=stage_order, param_specs=param_specs,
        )  # fmt: skip
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    # each launch is a recorded collective call on the mesh's group (docs/debugging.md)
    return recorded_step(jax.jit(step, donate_argnums=(0, 1) if donate else ()), mesh,
                         name="pipeline.train_step")
