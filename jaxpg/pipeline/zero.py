"""ZeRO-1 and ZeRO-2 over the data-parallel axis inside each pipeline stage.

As Megatron's distributed optimizer and Paddle's sharding-in-pipeline: every ``dp``
replica of a stage keeps a ``1/dp`` share of that stage's optimizer state (stage 1) and of
its reduced gradients (stage 2); each steps its share and the new parameters are
all-gathered over ``dp``. A stage stack leaf ``[S, d1, ...]`` (already split over ``pp``
on dim 0) is split over ``dp`` on dim 1, padded to a multiple of ``dp``; the embedding
and head leaves on dim 0. Stage 3 (sharded parameters) is
``make_train_step(..., zero_stage=3)`` (:mod:`jaxpg.pipeline.fully_sharded`): each stage
gathers its parameters once per microbatch, which Megatron and Paddle do not offer.

Example::

    mesh = jaxpg.ParallelDims(dp_replicate=2, pp=4)  # on 8 devices
    params, opt_state = init_zero_train_state(params, optax.adam(1e-3), mesh)
    step = make_zero_train_step(block, head_loss, optax.adam(1e-3), params, mesh=mesh,
                                zero_stage=2, schedule="1f1b", num_microbatches=8,
                                first_fn=embed)
    params, opt_state, loss = step(params, opt_state, inputs, targets)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpg.data_parallel.leaf_split import LeafSplit
from jaxpg.data_parallel.zero import (
    abstract_sharded_opt_state,
    init_sharded_opt_state,
    resolve_zero_stage,
    sharded_update,
)
from jaxpg.fsdp.collectives import Comm, reduce_leaf
from jaxpg.fsdp.mixed_precision import MixedPrecisionPolicy
from jaxpg.groups.resolve import resolve_mesh
from jaxpg.pipeline.api import StagedParams, pipeline_value_and_grad
from jaxpg.pipeline.param_placement import place_pipeline_params

__all__ = ["pipeline_layouts", "init_zero_train_state", "make_zero_train_step",
           "zero2_grad_reducer"]


def _mesh(mesh: Any, pp_axis: str, dp_axis: str) -> Mesh:
    mesh = resolve_mesh(mesh, api="jaxpg.fsdp.pipeline")
    if pp_axis not in mesh.axis_names \
            or dp_axis not in mesh.axis_names:
        raise ValueError(
            f"ZeRO inside a pipeline needs a mesh with a pipeline axis {pp_axis!r} and a "
            f"data-parallel axis {dp_axis!r} (a ParallelDims, a HybridCommunicateGroup"
            f" or a DeviceMesh); got {mesh!r}."
        )
    return mesh


def _staged(params: Any) -> tuple[StagedParams, bool]:
    return (params, False) if isinstance(params, StagedParams) else (StagedParams(params), True)


def pipeline_layouts(params: StagedParams | Any, mesh: Any, *, pp_axis: str = "pp",
                     dp_axis: str = "dp") -> StagedParams:
    """The ``LeafSplit`` of every leaf: stage stacks on dim 1, the rest on dim 0."""
    mesh = _mesh(mesh, pp_axis, dp_axis)
    staged, _ = _staged(params)
    n = mesh.shape[dp_axis]
    stages = jax.tree.map(lambda a: LeafSplit.of(a.shape, a.dtype, n, dim=1,
                                                   base_spec=P(pp_axis)), staged.stages)
    whole = lambda a: LeafSplit.of(a.shape, a.dtype, n)
    return StagedParams(stages, jax.tree.map(whole, staged.first),
                        jax.tree.map(whole, staged.last))


def _bare(tree: StagedParams, bare: bool) -> Any:
    return tree.stages if bare else tree


def init_zero_train_state(params: StagedParams | Any, optimizer: optax.GradientTransformation,
                          mesh: Any, *, pp_axis: str = "pp",
                          dp_axis: str = "dp") -> tuple[Any, Any]:
    """Places ``params`` as ``init_train_state`` does and builds the optimizer state split
    over ``dp_axis`` (ZeRO-1 and 2 store the same state).

    Returns:
        ``(placed_params, opt_state)``.
    """
    jmesh = _mesh(mesh, pp_axis, dp_axis)
    placed = place_pipeline_params(params, jmesh, pp_axis=pp_axis)
    staged, _ = _staged(placed)
    layouts = pipeline_layouts(staged, jmesh, pp_axis=pp_axis, dp_axis=dp_axis)
    opt, _ = init_sharded_opt_state(optimizer, staged, layouts, jmesh, (dp_axis,),
                                    params_padded=False)
    return placed, opt


def zero2_grad_reducer(layouts: StagedParams, *, pp_axis: str = "pp",
                       dp_axis: str = "dp", num_dp: int) -> Callable[[Any], Any]:
    """A ``grad_reducer`` that reduce-scatters each rank's stage gradients over ``dp``.

    Each leaf is averaged over ``dp`` and only this rank's part of it (on the layout's
    dimension, padded) is kept; ``reducer.grad_spec`` tells the executor how the output is
    laid out.
    """
    comm = Comm((dp_axis,), (), num_dp, MixedPrecisionPolicy())

    def reducer(grads: StagedParams) -> StagedParams:
        return jax.tree.map(lambda g, lay: reduce_leaf(g, lay, comm), grads, layouts)

    def stage_spec(lay: LeafSplit) -> P:  # the executor's [v, p, ...] view
        return P(None, pp_axis, dp_axis) if lay.sharded else P(None, pp_axis)

    reducer.grad_spec = StagedParams(
        jax.tree.map(stage_spec, layouts.stages),
        jax.tree.map(lambda lay: lay.spec((dp_axis,)), layouts.first),
        jax.tree.map(lambda lay: lay.spec((dp_axis,)), layouts.last),
    )
    return reducer


def make_zero_train_step(
    stage_fn: Callable[[Any, Any], Any],
    loss_fn: Callable[[Any, Any, Any], Any],
    optimizer: optax.GradientTransformation,
    params: StagedParams | Any,
    *,
    mesh: Any,
    zero_stage: int = 1,
    pp_axis: str = "pp",
    dp_axis: str = "dp",
    donate: bool = True,
    **pipeline_kwargs: Any,
) -> Callable[[Any, Any, Any, Any], tuple[Any, Any, jax.Array]]:
    """``make_train_step`` with the optimizer state (and, at stage 2, the gradients) split
    over ``dp_axis``: ``step(params, opt_state, inputs, targets) -> (params, opt_state,
    loss)`` for the state :func:`init_zero_train_state` makes.

    Args:
        stage_fn, loss_fn, optimizer: as ``make_train_step``.
        params: the parameters (placed, or their shapes): the layouts are made from them.
        mesh: the ``(dp, pp)`` mesh.
        zero_stage: 1 (optimizer state) or 2 (and gradients: a reduce-scatter over ``dp``
            instead of the all-reduce).
        pp_axis, dp_axis: the mesh axes.
        donate: donate the parameter and optimizer-state buffers.
        **pipeline_kwargs: ``schedule``, ``num_microbatches``, ``first_fn``, ``remat``,
            ``stage_order`` for ``pipeline_value_and_grad``.

    Raises:
        ValueError: for a ``zero_stage`` other than 1 or 2, or a mesh without the axes.
    """
    zero_stage = resolve_zero_stage(
        "make_zero_train_step", (1, 2), 1, zero_stage,
        hint=" Stages 0 (replicated) and 3 (sharded parameters) are "
             "jaxpg.pipeline.make_train_step(zero_stage=).")
    if "grad_reducer" in pipeline_kwargs:
        raise ValueError("make_zero_train_step reduces the gradients itself; drop grad_reducer.")
    if pipeline_kwargs.get("param_specs") is not None:
        raise ValueError(
            f"make_zero_train_step: param_specs={pipeline_kwargs['param_specs']!r} (tensor-"
            "parallel stages) is not supported with ZeRO inside a pipeline yet; train a "
            "tensor-parallel pipeline with jaxpg.pipeline.make_train_step (replicated "
            "optimizer state), or drop param_specs."
        )
    jmesh = _mesh(mesh, pp_axis, dp_axis)
    staged, bare = _staged(params)
    layouts = pipeline_layouts(staged, jmesh, pp_axis=pp_axis, dp_axis=dp_axis)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), staged)
    _, opt_shardings = abstract_sharded_opt_state(optimizer, abstract, layouts, jmesh,
                                                  (dp_axis,), params_padded=False)
    reducer = None
    if zero_stage == 2:
        reducer = zero2_grad_reducer(layouts, pp_axis=pp_axis, dp_axis=dp_axis,
                                     num_dp=jmesh.shape[dp_axis])

    def step(params, opt_state, inputs, targets):
        tree, _ = _staged(params)
        loss, grads = pipeline_value_and_grad(
            stage_fn, loss_fn, tree, inputs, targets, mesh=jmesh, pp_axis=pp_axis,
            dp_axis=dp_axis, grad_reducer=reducer, **pipeline_kwargs)
        new_params, new_opt = sharded_update(
            optimizer, grads, opt_state, tree, layouts, mesh=jmesh, axes=(dp_axis,),
            opt_shardings=opt_shardings, grads_padded=zero_stage == 2, params_padded=False)
        return _bare(new_params, bare), new_opt, loss.astype(jnp.float32)

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())
