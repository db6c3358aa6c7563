"""What one pipeline call runs, and the protocol of the executors that run it.

``pipeline_value_and_grad`` resolves its arguments once into a :class:`PipelineConfig`
and hands it to one of two executors, each a :class:`PipelineExecutor`:

* the lockstep executor (``jaxpg.pipeline.lockstep.executor``, ``executor="spmd"``): one jitted
  program over the whole mesh;
* the process executor (``jaxpg.pipeline.process.executor``, ``executor="mpmd"``): each process runs
  its own rank's actions from host code.

Both return the same loss and gradients for the same config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
from jax.sharding import Mesh

from jaxpg.pipeline.stage.params import StagedParams

__all__ = ["PipelineConfig", "PipelineExecutor"]


class PipelineConfig(NamedTuple):
    """One pipeline call, resolved; hashable, so a compiled step can be cached on it.

    Attributes:
        stage_fn: ``stage_fn(stage_params, x) -> y``, keyed by code and closure.
        loss_fn: ``loss_fn(last_params, y, targets_mb) -> scalar``, keyed likewise.
        first_fn: ``first_fn(first_params, inputs_mb) -> x`` on stage 0, or None.
        mesh: the jax ``Mesh`` with the pipeline axis (and the data-parallel one, if any).
        timetable: the schedule's ``Timetable`` for this mesh and stack.
        pp_axis: the pipeline axis.
        dp_axis: the data-parallel axis, or None when the mesh has none.
        grad_reducer: reduces each rank's gradients over ``dp_axis`` (None: the default
            ``pmean``, or nothing without a data-parallel axis), keyed like ``stage_fn``.
        remat: recompute the stage forward in its backward instead of keeping residuals.
        stage_order: ``"model"`` or ``"rank"``, the order of the stage stacks.
        param_specs: ``(leaves, treedef)`` of a ``StagedParams`` of ``PartitionSpec``
            trees for parameters split over another mesh axis, or None.
        cp_axis: the context-parallel axis, over which the inputs and targets are split
            along their sequence dimension (1), or None.
    """

    stage_fn: Callable
    loss_fn: Callable
    first_fn: Callable | None
    mesh: Mesh
    timetable: Any
    pp_axis: str
    dp_axis: str | None
    grad_reducer: Callable | None
    remat: bool
    stage_order: str
    param_specs: tuple | None = None
    cp_axis: str | None = None

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes whose ranks each pipeline their own part of the batch (rows over
        ``dp_axis``, the sequence over ``cp_axis``)."""
        return tuple(a for a in (self.dp_axis, self.cp_axis) if a is not None)


class PipelineExecutor(Protocol):
    """Runs one pipeline call: ``(cfg, params, inputs, targets) -> (loss, grads)``, the mean
    loss over the batch and gradients of the same structure as ``params``."""

    def __call__(self, cfg: PipelineConfig, params: StagedParams, inputs: Any,
                 targets: Any) -> tuple[jax.Array, StagedParams]: ...
