"""DP x PP: DDP's bucketed reducer over the data-parallel axis for each stage's gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jaxpg.ddp import allreduce_hook, make_bucket_plan, reduce_gradients
from jaxpg.pipeline.stage.params import StagedParams

__all__ = ["bucketed_grad_reducer"]


def bucketed_grad_reducer(
    params: StagedParams | Any,
    num_stage_ranks: int,
    *,
    dp_axis: str = "dp",
    bucket_cap_mb: float = 25,
    first_bucket_mb: float = 1,
    comm_hook: Callable[..., Any] = allreduce_hook,
) -> Callable[[Any], Any]:
    """Returns a ``grad_reducer`` for ``pipeline_value_and_grad`` that runs DDP's reducer.

    Each pipeline rank holds ``v = S / p`` stages of the model-order stack, so its bucket
    plan is made from those local shapes (``[v, ...]`` per stage leaf) plus the embedding
    and head; every rank of the data-parallel axis then averages its stage's gradients
    bucket by bucket, as DistributedDataParallel would.

    Args:
        params: the model's parameters, a ``StagedParams`` or a bare stage stack.
        num_stage_ranks: ``p``, the size of the pipeline axis.
        dp_axis: the data-parallel mesh axis (``dims.axis("dp_replicate")`` on a
            ``ParallelDims``).
        bucket_cap_mb: DDP's bucket cap.
        first_bucket_mb: DDP's first bucket.
        comm_hook: a stateless communication hook (allreduce, fp16/bf16 compress).

    Example:
        >>> reducer = bucketed_grad_reducer(params, 4)
        >>> pipeline_value_and_grad(..., mesh=hcg, grad_reducer=reducer)
    """
    staged = params if isinstance(params, StagedParams) else StagedParams(params)
    leaves = jax.tree.leaves(staged.stages)
    total = leaves[0].shape[0] if leaves else 0
    if total % num_stage_ranks:
        raise ValueError(f"bucketed_grad_reducer: the stage stack has {total} stages, not a "
                         f"multiple of num_stage_ranks={num_stage_ranks}.")
    v = total // num_stage_ranks
    local = StagedParams(
        jax.tree.map(lambda a: jax.ShapeDtypeStruct((v, *a.shape[1:]), a.dtype), staged.stages),
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), staged.first),
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), staged.last),
    )
    plan = make_bucket_plan(local, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb)
    bare = not isinstance(params, StagedParams)

    def reducer(grads: Any) -> Any:
        tree = grads if isinstance(grads, StagedParams) else StagedParams(grads)
        try:
            out, _ = reduce_gradients(tree, plan, dp_axis, comm_hook=comm_hook)
        except NameError as err:  # jax's "unbound axis name": the mesh has no such axis
            if dp_axis not in str(err):
                raise
            raise ValueError(
                f"bucketed_grad_reducer: dp_axis={dp_axis!r} is not an axis of the pipeline's "
                f"mesh ({err}). Pass the mesh's data-parallel axis: on a ParallelDims, "
                f"dp_axis=dims.axis('dp_replicate').") from err
        return out.stages if bare and not isinstance(grads, StagedParams) else out

    reducer.plan = plan  # printable: print(reducer.plan)
    return reducer
