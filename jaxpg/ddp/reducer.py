"""Bucketed gradient reduction inside ``shard_map``: torch's DDP ``Reducer``.

:func:`reduce_gradients` applies a :class:`~jaxpg.ddp.BucketPlan`: for each
bucket it concatenates the raveled gradients into one contiguous 1-D buffer,
hands it to a communication hook (by default an average over the mesh axis) and
cuts the result back into gradients. It must run inside ``jax.shard_map`` over
a mesh that has ``axis_name``.

Each bucket's collective reads only its own gradients, so in the compiled
program it can start as soon as backward has produced those gradients (the last
layers' first, which is why the plan is in reversed definition order) and run
while backward continues. Whether XLA actually overlaps them is up to its
scheduler; on GPU the flags that matter are (set through ``XLA_FLAGS``; names
as of jaxlib 0.4.3x-0.10):

- ``--xla_gpu_enable_latency_hiding_scheduler=true``: lets XLA move the
  collectives' start and done apart and schedule compute in between.
- Async all-reduce is on by default in current XLA; do not list ``allreduce``
  in ``--xla_gpu_disable_async_collectives``. (Older jaxlibs had
  ``--xla_gpu_enable_async_all_reduce=true``.)
- ``--xla_gpu_all_reduce_combine_threshold_bytes``: XLA's all-reduce combiner
  merges independent all-reduces up to this many bytes. A large value (some
  recipes use 8 GiB) glues the buckets back into one all-reduce that can only
  start after the whole backward pass, which undoes the bucketing; set it to
  about the bucket cap (e.g. ``26214400`` for 25 MiB) to keep the buckets.
- ``--xla_gpu_enable_highest_priority_async_stream=true``: gives collectives
  their own high-priority stream so they do not wait behind compute kernels.
- ``--xla_gpu_enable_pipelined_all_reduce`` only matters for all-reduces inside
  loops (gradient accumulation with ``lax.scan``).

On CPU none of these flags apply. The bucket count is visible as the number of
``all_reduce`` ops in the lowered program, but XLA:CPU's ``cpu-all-reduce-combiner``
pass then merges a step's independent all-reduces into one (in the compiled HLO), which
runs after the whole backward; ``--xla_disable_hlo_passes=cpu-all-reduce-combiner``
keeps one per bucket (measured in docs/design.md, "CPU all_reduce: where the time goes":
it does not make them overlap the backward).
So on CPU DDP's step calls ``reduce_gradients(..., flat_buffers=False)``: with the
default hook each bucket's gradients are reduced as they are, without the copies into
and out of a flat buffer; custom hooks still get flat buffers.
:func:`fused_pmean` is the unbucketed reference: one ``pmean`` per gradient,
leaving all grouping to XLA's combiner.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpg.ddp._axis import AxisName, axis_size, axis_tuple
from jaxpg.ddp._flat import concat_1d
from jaxpg.ddp.bucket_plan import BucketPlan
from jaxpg.ddp.comm_hooks import CommHook, allreduce_hook
from jaxpg.ddp.grad_bucket import GradBucket


def _check_against_plan(leaves_with_paths: list, plan: BucketPlan) -> None:
    paths = tuple(jax.tree_util.keystr(p) for p, _ in leaves_with_paths)
    if paths != plan.leaf_paths:
        if len(paths) != len(plan.leaf_paths):
            detail = f"{len(paths)} gradients for a plan of {len(plan.leaf_paths)} parameters"
        else:
            i = next(
                i for i, (a, b) in enumerate(zip(paths, plan.leaf_paths, strict=True)) if a != b
            )
            detail = f"gradient {i} is at {paths[i]}, the plan has {plan.leaf_paths[i]}"
        raise ValueError(
            f"The gradients do not match the bucket plan: {detail}. Make the plan from the "
            "same parameter pytree the gradients are taken with respect to."
        )
    for (_, leaf), path, shape, dtype in zip(
        leaves_with_paths, paths, plan.leaf_shapes, plan.leaf_dtypes, strict=True
    ):
        if tuple(leaf.shape) != shape or np.dtype(leaf.dtype) != dtype:
            raise ValueError(
                f"The gradient at {path} has shape {tuple(leaf.shape)} and dtype {leaf.dtype}, "
                f"the bucket plan expects {shape} and {dtype}. Inside shard_map the gradients "
                "are the per-rank (local) ones; make the plan from the local parameters, or "
                "cast the gradients to the parameters' dtype."
            )


def reduce_gradients(
    grads: Any,
    plan: BucketPlan,
    axis_name: AxisName,
    comm_hook: CommHook = allreduce_hook,
    hook_state: Any = None,
    *,
    flat_buffers: bool = True,
) -> tuple[Any, Any]:
    """Reduces a gradient pytree bucket by bucket through a communication hook.

    Call it inside ``jax.shard_map`` over a mesh with ``axis_name``.

    Args:
        grads: this rank's gradients, a pytree matching ``plan``.
        plan: the bucket assignment, from :func:`~jaxpg.ddp.make_bucket_plan`.
        axis_name: the data-parallel mesh axis (or tuple of axes) to reduce over.
        comm_hook: ``hook(state, GradBucket) -> (buffer, state)``, called once per
            bucket in plan order; defaults to averaging over the axis.
        hook_state: the hook's state (``None`` for stateless hooks).
        flat_buffers: build each bucket's flat buffer even for the default hook. With
            ``False`` and the default :func:`~jaxpg.ddp.allreduce_hook`, each bucket is
            reduced as one variadic ``psum`` of its gradients, without the copies into and
            out of a flat buffer (same values; DDP does this on CPU, see
            :func:`~jaxpg.ddp.train_step.build_train_step`). Other hooks always get the
            flat buffer.

    Returns:
        ``(reduced gradients, new hook state)``; the gradients have the input's
        structure, shapes and dtypes.

    Raises:
        ValueError: if the gradients do not match the plan, or a hook returns a
            buffer of the wrong shape or dtype.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import PartitionSpec as P
        >>> from jaxpg.ddp import make_bucket_plan, reduce_gradients
        >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("dp",))
        >>> grads = {"w": jnp.ones((2, 3))}
        >>> plan = make_bucket_plan(grads)
        >>> step = jax.shard_map(lambda g: reduce_gradients(g, plan, "dp")[0],
        ...                      mesh=mesh, in_specs=P(), out_specs=P())
        >>> jax.jit(step)(grads)["w"].shape
        (2, 3)
    """
    axis_tuple(axis_name)
    if not isinstance(plan, BucketPlan):
        raise TypeError(f"plan must be a BucketPlan from make_bucket_plan, got {type(plan)}.")
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(grads)
    _check_against_plan(leaves_with_paths, plan)
    leaves = [leaf for _, leaf in leaves_with_paths]
    out_leaves: list[Any] = list(leaves)
    if comm_hook is allreduce_hook and not flat_buffers:
        for bucket in plan.buckets:
            parts = _average_unflattened([leaves[i] for i in bucket.leaf_indices], axis_name)
            for i, part in zip(bucket.leaf_indices, parts, strict=True):
                out_leaves[i] = part
        return jax.tree_util.tree_unflatten(treedef, out_leaves), hook_state
    last = len(plan.buckets) - 1
    for bucket in plan.buckets:
        buffer = concat_1d([leaves[i] for i in bucket.leaf_indices])
        grad_bucket = GradBucket(
            index=bucket.index,
            buffer=buffer,
            paths=bucket.paths,
            is_last=bucket.index == last,
            axis_name=axis_name,
            shapes=bucket.shapes,
            offsets=bucket.offsets,
        )
        reduced, hook_state = comm_hook(hook_state, grad_bucket)
        if reduced.shape != buffer.shape or reduced.dtype != buffer.dtype:
            raise ValueError(
                f"The communication hook returned a buffer of shape {reduced.shape} and dtype "
                f"{reduced.dtype} for bucket {bucket.index}, which has shape {buffer.shape} "
                f"and dtype {buffer.dtype}; a hook must return a buffer like its input."
            )
        for i, piece in zip(bucket.leaf_indices, grad_bucket.gradients(reduced), strict=True):
            out_leaves[i] = piece
    return jax.tree_util.tree_unflatten(treedef, out_leaves), hook_state


def _average_unflattened(parts: list[Any], axis_name: AxisName) -> list[Any]:
    """The default hook on one bucket without its flat buffer: ``psum`` of the list.

    The values are those of :func:`~jaxpg.ddp.allreduce_hook`: each gradient divided by
    the world size, then summed over the axis. JAX lowers the list to one ``all_reduce``
    per gradient; XLA's all-reduce combiner regroups them.
    """
    world_size = axis_size(axis_name)
    if world_size == 1:  # a one-rank data-parallel axis (tensor parallelism alone): no op
        return list(parts)
    return jax.lax.psum([p / jnp.asarray(world_size, p.dtype) for p in parts], axis_name)


def fused_pmean(grads: Any, axis_name: AxisName) -> Any:
    """Averages every gradient over ``axis_name`` with one ``pmean`` per leaf.

    The unbucketed reference for benchmarks: XLA's all-reduce combiner decides
    how the per-leaf collectives are grouped.
    """
    if axis_size(axis_name) == 1:
        return grads
    return jax.tree_util.tree_map(lambda g: jax.lax.pmean(g, axis_name), grads)
