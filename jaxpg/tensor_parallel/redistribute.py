"""Moving a tensor from one placement to another, in SPMD code and in host code.

* :func:`redistribute_local` (SPMD code): this rank's local part in, local part out, through
  the Megatron operators of :mod:`~jaxpg.tensor_parallel.mappings`.
* :func:`to_global` and :func:`to_local` (host code): a tensor in host code is one global
  ``jax.Array`` (JAX's DTensor). :func:`to_global` lays one out by a placement: a global
  array or a traced value is resharded; anything else is this *process's* local data
  (``jax.make_array_from_process_local_data``): with one rank per process that is the rank's
  local tensor (torch's ``DTensor.from_local``), with one process holding every rank it is the
  whole tensor. :func:`to_local` is the inverse (torch's ``to_local()`` with one rank per
  process; the global array itself in one process).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from jaxpg.groups.mesh_axis import MeshAxis
from jaxpg.tensor_parallel import mappings as ops
from jaxpg.tensor_parallel.placements import Placement, Shard, layout_spec, normalize_dim

__all__ = ["redistribute_local", "to_global", "to_local", "is_traced"]


def is_traced(x: Any) -> bool:
    """Whether ``x`` is a value being traced (under jit, grad, shard_map, ...)."""
    return isinstance(x, jax.core.Tracer)


def redistribute_local(
    x: jax.Array, src: Placement, dst: Placement, axis: str, *, partial_grad: bool = False
) -> jax.Array:
    """This rank's part of ``x`` laid out ``src``, as its part laid out ``dst`` (SPMD code).

    Args:
        x: the local part.
        src: how ``x`` is laid out now.
        dst: how it should be.
        axis: the tensor-parallel mesh axis.
        partial_grad: the consumer of a ``Replicate`` result returns per-rank partial
            gradients (a column-parallel matmul): the backward then sums them, by an
            all-reduce (``src`` Replicate, Megatron's ``f``) or a reduce-scatter (``src``
            ``Shard``, sequence parallelism), instead of trusting them to be complete.

    Raises:
        ValueError: for a move into ``Partial``.
    """
    if dst.is_partial():
        if src.is_partial():
            return x
        raise ValueError(f"cannot redistribute {src} to {dst}: nothing produces a Partial "
                         "tensor from a complete one in tensor parallelism.")
    if src.is_partial():
        if dst.is_replicate():
            return ops.reduce_from_tensor_parallel_region(x, axis)
        return ops.reduce_scatter_to_sequence_parallel_region(x, axis, _dim(dst, x))
    if src.is_replicate():
        if dst.is_replicate():
            return ops.copy_to_tensor_parallel_region(x, axis) if partial_grad else x
        return ops.scatter_to_tensor_parallel_region(x, axis, _dim(dst, x))
    a = _dim(src, x)
    if dst.is_replicate():
        return ops.gather_from_sequence_parallel_region(
            x, axis, a, tensor_parallel_output_grad=partial_grad)
    b = _dim(dst, x)
    if a == b:
        return x
    return ops.all_to_all_region(x, axis, split_dim=b, concat_dim=a)


def _dim(p: Placement, x: jax.Array) -> int:
    assert isinstance(p, Shard)
    return normalize_dim(p.dim, x.ndim)


def to_global(x: Any, placement: Placement, tp: MeshAxis) -> jax.Array:
    """``x`` as a global array on ``tp.mesh`` laid out by ``placement`` (host code).

    A traced value, or a global ``jax.Array`` spanning several processes, is resharded (its
    value is the tensor); anything else (numpy data, an array on this process's devices) is
    this process's local data of the tensor, which in a one-process world is all of it.
    """
    ndim = np.ndim(x)
    sharding = NamedSharding(tp.mesh, layout_spec(placement, ndim, tp.axis))
    if is_traced(x):
        return jax.lax.with_sharding_constraint(x, sharding)
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    return jax.make_array_from_process_local_data(sharding, np.asarray(x))


def to_local(y: jax.Array, tp: MeshAxis) -> jax.Array:
    """This process's local data of the global array ``y`` (``y`` itself in one process)."""
    if is_traced(y) or not isinstance(y, jax.Array) or y.is_fully_addressable:
        return y
    spec = y.sharding.spec if isinstance(y.sharding, NamedSharding) else None
    return multihost_utils.global_array_to_host_local_array(y, tp.mesh, spec)
