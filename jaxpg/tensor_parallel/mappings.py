"""Megatron's communication operators for SPMD code, each a ``jax.custom_vjp``.

Called inside SPMD code (``jaxpg.spmd``, DDP's step, the pipeline) that binds the
tensor-parallel ``axis``; every argument is this rank's local array. The forward and the
backward each issue exactly the collective Megatron-LM's operator does, so a compiled step
has Megatron's collective count (its ``f`` and ``g`` operators are the first two):

====================================  ====================  ====================
operator                              forward               backward
====================================  ====================  ====================
copy_to_tensor_parallel_region (f)    identity              all-reduce
reduce_from_tensor_parallel_region    all-reduce            identity
scatter_to_tensor_parallel_region     split (local slice)   all-gather
gather_from_tensor_parallel_region    all-gather            split
scatter_to_sequence_parallel_region   split                 all-gather
gather_from_sequence_parallel_region  all-gather            reduce-scatter, or
                                                            split
reduce_scatter_to_sequence_...        reduce-scatter        all-gather
====================================  ====================  ====================

The convention behind them (Megatron's): the gradient of a value that is the same on every
rank (``Replicate``) is complete and the same on every rank, so replicated parameters get
their full gradient without any further reduction, and a loss computed identically on every
tensor-parallel rank seeds its backward with 1 on each.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

__all__ = [
    "copy_to_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region",
    "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "all_to_all_region",
    "gather_with_partial_twin",
]


def _split(x: jax.Array, axis: str, dim: int) -> jax.Array:
    n = lax.axis_size(axis)
    if x.shape[dim] % n:
        raise ValueError(
            f"cannot split dimension {dim} of size {x.shape[dim]} over the {n} ranks of "
            f"axis {axis!r}; it must be divisible by {n}."
        )
    chunk = x.shape[dim] // n
    return lax.dynamic_slice_in_dim(x, lax.axis_index(axis) * chunk, chunk, axis=dim)


def _gather(x: jax.Array, axis: str, dim: int) -> jax.Array:
    return lax.all_gather(x, axis, axis=dim, tiled=True)


def _reduce_scatter(x: jax.Array, axis: str, dim: int) -> jax.Array:
    n = lax.axis_size(axis)
    if x.shape[dim] % n:
        raise ValueError(
            f"cannot reduce-scatter dimension {dim} of size {x.shape[dim]} over the {n} ranks "
            f"of axis {axis!r}; it must be divisible by {n}."
        )
    return lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)


def _dim(x: jax.Array, dim: int) -> int:
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim={dim} is out of range for an array of shape {x.shape}.")
    return dim % x.ndim


# ----------------------------------------------------------------------------- f and g
@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _copy(x, axis):
    return x


_copy.defvjp(lambda x, axis: (x, None), lambda axis, _, g: (lax.psum(g, axis),))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _reduce(x, axis):
    return lax.psum(x, axis)


_reduce.defvjp(lambda x, axis: (lax.psum(x, axis), None), lambda axis, _, g: (g,))


def copy_to_tensor_parallel_region(x: jax.Array, axis: str) -> jax.Array:
    """Megatron's ``f``: identity forward, all-reduce of the gradient backward.

    Put it where a replicated value enters per-rank partial work (a column-parallel matmul):
    each rank's gradient is then a partial sum, which the backward all-reduces.
    """
    return _copy(x, axis)


def reduce_from_tensor_parallel_region(x: jax.Array, axis: str) -> jax.Array:
    """Megatron's ``g``: all-reduce forward, identity backward (after a row-parallel matmul)."""
    return _reduce(x, axis)


# ----------------------------------------------------------------------------- split/gather
@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _scatter(x, axis, dim):
    return _split(x, axis, dim)


_scatter.defvjp(lambda x, axis, dim: (_split(x, axis, dim), None),
                lambda axis, dim, _, g: (_gather(g, axis, dim),))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_split(x, axis, dim):
    return _gather(x, axis, dim)


_gather_split.defvjp(lambda x, axis, dim: (_gather(x, axis, dim), None),
                     lambda axis, dim, _, g: (_split(g, axis, dim),))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_rs(x, axis, dim):
    return _gather(x, axis, dim)


_gather_rs.defvjp(lambda x, axis, dim: (_gather(x, axis, dim), None),
                  lambda axis, dim, _, g: (_reduce_scatter(g, axis, dim),))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _rs(x, axis, dim):
    return _reduce_scatter(x, axis, dim)


_rs.defvjp(lambda x, axis, dim: (_reduce_scatter(x, axis, dim), None),
           lambda axis, dim, _, g: (_gather(g, axis, dim),))


def _integer(x: jax.Array) -> bool:
    return not jnp.issubdtype(x.dtype, jnp.inexact)


def scatter_to_tensor_parallel_region(x: jax.Array, axis: str, dim: int = -1) -> jax.Array:
    """Keeps this rank's chunk of dimension ``dim``; backward all-gathers the gradient."""
    dim = _dim(x, dim)
    return _split(x, axis, dim) if _integer(x) else _scatter(x, axis, dim)


def gather_from_tensor_parallel_region(x: jax.Array, axis: str, dim: int = -1) -> jax.Array:
    """All-gathers dimension ``dim`` (group-rank order); backward keeps this rank's chunk."""
    dim = _dim(x, dim)
    return _gather(x, axis, dim) if _integer(x) else _gather_split(x, axis, dim)


def scatter_to_sequence_parallel_region(x: jax.Array, axis: str, dim: int = 1) -> jax.Array:
    """Sequence parallelism's entry: keeps this rank's chunk of the sequence ``dim``."""
    return scatter_to_tensor_parallel_region(x, axis, dim)


def gather_from_sequence_parallel_region(
    x: jax.Array, axis: str, dim: int = 1, tensor_parallel_output_grad: bool = True
) -> jax.Array:
    """All-gathers the sequence ``dim`` before a column-parallel matmul.

    Args:
        x: this rank's sequence chunk.
        axis: the tensor-parallel axis.
        dim: the sequence dimension.
        tensor_parallel_output_grad: the gradient that comes back is a per-rank partial
            sum (the consumer is a column-parallel matmul), so the backward reduce-scatters
            it (Megatron's default); False: the gradient is complete on every rank and the
            backward keeps this rank's chunk.
    """
    dim = _dim(x, dim)
    if _integer(x):
        return _gather(x, axis, dim)
    return _gather_rs(x, axis, dim) if tensor_parallel_output_grad else _gather_split(x, axis, dim)


def reduce_scatter_to_sequence_parallel_region(x: jax.Array, axis: str, dim: int = 1) -> jax.Array:
    """Sums per-rank partials and keeps this rank's sequence chunk (after a row-parallel
    matmul); backward all-gathers the gradient."""
    return _rs(x, axis, _dim(x, dim))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_twin(x, axis, dim):
    full = _gather(x, axis, dim)
    return full, full


def _gather_twin_fwd(x, axis, dim):
    full = _gather(x.value, axis, dim)  # symbolic_zeros: x is a CustomVJPPrimal
    return (full, full), x.value.shape


def _gather_twin_bwd(axis, dim, shape, g):
    # An output nobody used has a symbolic zero gradient: no collective for it.
    parts = []
    g_full, g_partial = g
    if not isinstance(g_full, SymbolicZero):
        parts.append(_split(g_full, axis, dim))
    if not isinstance(g_partial, SymbolicZero):
        parts.append(_reduce_scatter(g_partial, axis, dim))
    if not parts:
        return (jnp.zeros(shape, g_full.aval.dtype),)
    return (functools.reduce(jnp.add, parts),)


_gather_twin.defvjp(_gather_twin_fwd, _gather_twin_bwd, symbolic_zeros=True)


def gather_with_partial_twin(x: jax.Array, axis: str, dim: int) -> tuple[jax.Array, jax.Array]:
    """One all-gather of ``dim``, returned twice: the first output's gradient is complete on
    every rank (backward keeps this rank's chunk), the second's is a per-rank partial sum
    (backward reduce-scatters it). See :mod:`~jaxpg.tensor_parallel.shared_inputs`."""
    return _gather_twin(x, axis, _dim(x, dim))


# ----------------------------------------------------------------------------- all-to-all
@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _a2a(x, axis, split_dim, concat_dim):
    return lax.all_to_all(x, axis, split_dim, concat_dim, tiled=True)


_a2a.defvjp(
    lambda x, axis, s, c: (lax.all_to_all(x, axis, s, c, tiled=True), None),
    lambda axis, s, c, _, g: (lax.all_to_all(g, axis, c, s, tiled=True),),
)


def all_to_all_region(x: jax.Array, axis: str, split_dim: int, concat_dim: int) -> jax.Array:
    """Moves the split from ``concat_dim`` to ``split_dim`` (``Shard(concat_dim)`` to
    ``Shard(split_dim)``); backward moves it back."""
    return _a2a(x, axis, _dim(x, split_dim), _dim(x, concat_dim))
