"""FSDP's two collectives on one parameter, inside ``shard_map``: all-gather the shard
before use, reduce-scatter (and average) the gradient after.

:func:`gather_leaf` casts the local shard to the compute dtype (the mixed-precision
policy's ``param_dtype``), all-gathers it over the shard axes (tiled on dim 0) and drops
the padding rows. :func:`reduce_leaf` is its adjoint with torch FSDP2's numerics: the
unsharded gradient is cast to the reduce dtype, padded, reduce-scattered over the shard
axes, summed over the HSDP replica axes (and, for a parameter not split over them, over the
expert-parallel axes) and divided by the number of ranks (float32 and
bfloat16: after the sum, as NCCL's ``AVG``; float16: part before and part after, by
torch's ``_get_gradient_divide_factors``), then cast to the shard's dtype for the
optimizer. :func:`gather_param` ties the two into one differentiable operation
(``jax.custom_vjp``), as the root's parameters use them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpg.data_parallel.leaf_split import LeafSplit, spec_axes
from jaxpg.fsdp.mixed_precision import MixedPrecisionPolicy

__all__ = ["Comm", "divide_factors", "gather_leaf", "reduce_leaf", "allreduce_leaf",
           "gather_param"]


@dataclasses.dataclass(frozen=True)
class Comm:
    """The static facts the collectives need.

    Attributes:
        shard_axes: the mesh axes parameters are split over.
        replicate_axes: the HSDP replica axes (empty for FSDP).
        size: all ranks the batch is split over (shards x replicas x expert-parallel
            ranks): the gradient average's divisor.
        policy: the mixed-precision policy.
        expert_axes: expert-parallel axes the batch is split over too (``("ep",)``); a
            parameter split over them (an expert) is not summed over them, every other
            one is.
    """

    shard_axes: tuple[Hashable, ...]
    replicate_axes: tuple[Hashable, ...]
    size: int
    policy: MixedPrecisionPolicy
    expert_axes: tuple[Hashable, ...] = ()

    @property
    def all_axes(self) -> tuple[Hashable, ...]:
        return (*self.replicate_axes, *self.shard_axes)

    def extra_axes(self, layout: LeafSplit) -> tuple[Hashable, ...]:
        """The expert-parallel axes ``layout``'s gradient is summed over besides the shard
        and replica axes: all of them for a dense parameter, none for an expert."""
        return () if spec_axes(layout.base_spec) & set(self.expert_axes) else self.expert_axes


def divide_factors(n: int, dtype: Any) -> tuple[float | None, float | None]:
    """``(pre, post)`` divisors of a gradient average over ``n`` ranks (torch FSDP2's).

    float32 and bfloat16 divide once after the sum; float16 divides by a power of two
    near ``sqrt(n)`` before and the rest after, against overflow and underflow.
    """
    if n == 1:
        return None, None
    if np.dtype(dtype) in (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float64)):
        return None, float(n)
    pre = 1
    while n % pre == 0 and n / pre > pre:
        pre *= 2
    return float(pre), n / pre


def _size(axes: tuple[Hashable, ...]) -> int:
    """The number of ranks along ``axes`` (inside ``shard_map``)."""
    return int(np.prod([jax.lax.axis_size(a) for a in axes], dtype=np.int64))


def _padded(g: jax.Array, layout: LeafSplit) -> jax.Array:
    """The unsharded gradient padded to the shards' rows (a no-op unless the layout pads)."""
    if layout.sharded and layout.padding:
        width = [(0, 0)] * g.ndim
        width[layout.dim] = (0, layout.padded_block_dim0 - layout.block_dim0)
        g = jnp.pad(g, width)
    return g


def gather_leaf(shard: jax.Array, layout: LeafSplit, comm: Comm) -> jax.Array:
    """The unsharded parameter (its tensor-parallel block) from this rank's shard."""
    x = shard.astype(comm.policy.compute_dtype_for(layout.dtype))
    if not layout.sharded:
        return x
    if _size(comm.shard_axes) > 1:  # XLA:CPU would copy through a one-rank all-gather
        x = jax.lax.all_gather(x, comm.shard_axes, axis=layout.dim, tiled=True)
    if layout.padding:
        x = jax.lax.slice_in_dim(x, 0, layout.block_dim0, axis=layout.dim)
    return x


def reduce_leaf(grad: jax.Array, layout: LeafSplit, comm: Comm) -> jax.Array:
    """This rank's shard of the gradient averaged over every rank (stage 2 and 3)."""
    rd = comm.policy.reduce_dtype_for(layout.dtype)
    g = grad.astype(rd)
    if comm.size == 1:  # one rank: XLA:CPU would still run (and copy through) collectives
        return _padded(g, layout).astype(layout.dtype)
    pre, post = divide_factors(comm.size, rd)
    if pre is not None:
        g = g / jnp.asarray(pre, rd)
    extra = comm.extra_axes(layout)
    if not layout.sharded:
        g = jax.lax.psum(g, (*comm.all_axes, *extra))
    else:
        g = _padded(g, layout)
        if _size(comm.shard_axes) > 1:
            g = jax.lax.psum_scatter(g, comm.shard_axes, scatter_dimension=layout.dim,
                                     tiled=True)
        if comm.replicate_axes and _size(comm.replicate_axes) > 1:
            g = jax.lax.psum(g, comm.replicate_axes)
        if extra and _size(extra) > 1:
            g = jax.lax.psum(g, extra)
    if post is not None:
        g = g / jnp.asarray(post, rd)
    return g.astype(layout.dtype)


def allreduce_leaf(grad: jax.Array, layout: LeafSplit, comm: Comm) -> jax.Array:
    """The whole gradient averaged over every rank (stage 1: all-reduce, not scatter)."""
    rd = comm.policy.reduce_dtype_for(layout.dtype)
    g = grad.astype(rd)
    if comm.size == 1:  # one rank: XLA:CPU would still run (and copy through) the all-reduce
        return g.astype(layout.dtype)
    pre, post = divide_factors(comm.size, rd)
    if pre is not None:
        g = g / jnp.asarray(pre, rd)
    g = jax.lax.psum(g, (*comm.all_axes, *comm.extra_axes(layout)))
    if post is not None:
        g = g / jnp.asarray(post, rd)
    return g.astype(layout.dtype)


def accumulate(grad: jax.Array, acc: jax.Array | None) -> jax.Array:
    """``grad + acc`` in the accumulator's dtype (no ``acc``: ``grad``)."""
    return grad if acc is None else grad.astype(acc.dtype) + acc


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def gather_param(shard: jax.Array, acc: jax.Array | None, layout: LeafSplit, comm: Comm,
                 no_sync: bool) -> jax.Array:
    """:func:`gather_leaf` whose gradient is :func:`reduce_leaf`.

    ``acc`` is this rank's unsharded gradient accumulated under ``no_sync`` (or None):
    it is added before the reduction; with ``no_sync`` the gradient is not reduced at all
    and comes back as the cotangent of ``acc`` instead.
    """
    return gather_leaf(shard, layout, comm)


def _gather_fwd(shard, acc, layout, comm, no_sync):
    return gather_leaf(shard, layout, comm), acc


def _gather_bwd(layout, comm, no_sync, acc, ct):
    if no_sync:
        return None, ct.astype(acc.dtype)
    return reduce_leaf(accumulate(ct, acc), layout, comm), None


gather_param.defvjp(_gather_fwd, _gather_bwd)
