"""ZeRO-3 (FSDP) inside stacked pipeline stages: ``make_train_step(..., zero_stage=3)``.

Every parameter, stage stacks and embedding and head alike, is split over the
data-parallel axis on its first dimension that the axis' size divides (a leaf no dimension
of which it divides stays replicated). The optimizer state, made from the placed
parameters, follows them. The stage, embedding and head functions are wrapped to
all-gather their parameters before they run, per microbatch, as torch's FSDP2 does under
pipelining with ``reshard_after_forward=True``. The gather's transpose reduce-scatters each
microbatch's weight gradient; the lockstep executor then divides the gathered sum of every
rank's rows by the data-parallel size (``param_specs`` naming the dp axis,
``jaxpg.pipeline.lockstep.executor.data_parallel_mean``): the gradient of the whole
batch's mean loss, each rank holding its part.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpg.groups.resolve import resolve_mesh
from jaxpg.pipeline.stage.params import StagedParams

__all__ = ["fully_sharded_specs", "gathering"]


def _split_spec(shape: tuple[int, ...], size: int, axis: str) -> P:
    """``P`` splitting the first dimension of ``shape`` that ``size`` divides over ``axis``
    (``P()``: none does)."""
    for dim, n in enumerate(shape):
        if n % size == 0 and n >= size:
            return P(*(None,) * dim, axis)
    return P()


def fully_sharded_specs(params: StagedParams | Any, mesh: Any, dp_axis: str) -> StagedParams:
    """The ``param_specs`` of ZeRO-3 stages: each leaf split over ``dp_axis`` on its first
    dimension the axis' size divides (a stage leaf on one stage's shape, without the
    stack's leading dimension).

    Args:
        params: the parameters (or their shapes), a ``StagedParams`` or a stage stack.
        mesh: the pipeline's mesh, in any form ``pipeline_value_and_grad`` takes.
        dp_axis: the data-parallel axis of ``mesh``.

    Raises:
        ValueError: for a mesh without ``dp_axis``.
    """
    mesh = resolve_mesh(mesh, api="make_train_step")
    if dp_axis not in mesh.axis_names:
        raise ValueError(f"zero_stage=3 splits the parameters over the data-parallel axis, "
                         f"but the mesh has axes {mesh.axis_names} and no {dp_axis!r}; "
                         "pass dp_axis= or a mesh with a data-parallel degree.")
    size = mesh.shape[dp_axis]
    staged = params if isinstance(params, StagedParams) else StagedParams(params)
    return StagedParams(
        jax.tree.map(lambda a: _split_spec(tuple(np.shape(a))[1:], size, dp_axis),
                     staged.stages),
        jax.tree.map(lambda a: _split_spec(tuple(np.shape(a)), size, dp_axis), staged.first),
        jax.tree.map(lambda a: _split_spec(tuple(np.shape(a)), size, dp_axis), staged.last),
    )


def _gather(tree: Any, specs: Any, axis: str) -> Any:
    """Each leaf of ``tree`` whose spec splits it over ``axis`` all-gathered whole."""
    def one(a, spec):
        for dim, entry in enumerate(spec):
            if entry == axis:
                return lax.all_gather(a, axis, axis=dim, tiled=True)
        return a

    return jax.tree.map(one, tree, specs, is_leaf=lambda x: isinstance(x, P))


def gathering(fn: Callable[..., Any] | None, specs: Any, axis: str
              ) -> Callable[..., Any] | None:
    """``fn(params, *rest)`` run on ``params`` all-gathered over ``axis`` where ``specs``
    split them (inside the pipeline's ``shard_map``); None stays None."""
    if fn is None:
        return None

    @functools.wraps(fn)
    def gathered(params: Any, *rest: Any) -> Any:
        return fn(_gather(params, specs, axis), *rest)

    return gathered
