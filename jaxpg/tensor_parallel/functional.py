"""The computations of the tensor-parallel layers, in SPMD code and in host code.

Each function takes the layer's parameters and decides where it runs:

* **SPMD code** (a ``shard_map`` binding the tp axis: ``jaxpg.spmd``, DDP's step, the
  pipeline): parameters and activations are this rank's local parts, and the function issues
  Megatron's collectives (:mod:`~jaxpg.tensor_parallel.mappings`), no more.
* **host code**: parameters are global arrays; the inputs are laid out by their placement
  (:func:`~jaxpg.tensor_parallel.redistribute.to_global`), the unsharded computation runs on
  the global arrays (XLA partitions it), and the output is laid out by its placement, then
  handed back as this process's local data if ``use_local_output``. This path is for
  trying a layer out and for checking it: train inside SPMD code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax.nnx.nn import dtypes
from jax import lax

from jaxpg.groups.mesh_axis import MeshAxis
from jaxpg.tensor_parallel import mappings as ops
from jaxpg.tensor_parallel.placements import Partial, Placement, Replicate, Shard
from jaxpg.tensor_parallel.redistribute import redistribute_local, to_global, to_local
from jaxpg.tensor_parallel.shared_inputs import shared_twin

__all__ = ["dense", "column_parallel_linear", "row_parallel_linear",
           "vocab_parallel_embedding", "column_parallel_embedding", "check_local_shape"]

Matmul = Callable[[jax.Array, jax.Array], jax.Array]
REPLICATE: Placement = Replicate()
LAST_DIM: Placement = Shard(-1)


def dense(x: jax.Array, kernel: jax.Array, *, dtype: Any = None, precision: Any = None,
          dot_general: Callable[..., Any] = lax.dot_general,
          promote_dtype: Callable[..., Any] = dtypes.promote_dtype) -> jax.Array:
    """``x @ kernel`` over the last dimension of ``x``, as ``nnx.Linear`` computes it."""
    x, kernel = promote_dtype((x, kernel), dtype=dtype)
    return dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)


def _add_bias(y: jax.Array, bias: jax.Array | None) -> jax.Array:
    if bias is None:
        return y
    return y + jnp.reshape(bias.astype(y.dtype), (1,) * (y.ndim - 1) + (-1,))


def check_local_shape(value: Any, full: tuple[int, ...], local: tuple[int, ...], name: str,
                      api: str) -> None:
    """Checks, inside SPMD code, that a parameter arrived as this rank's shard."""
    shape = tuple(jnp.shape(value))
    if shape == tuple(local):
        return
    if shape == tuple(full):
        raise ValueError(
            f"{api}: inside SPMD code {name} has its full shape {full}, not this rank's shard "
            f"{local}; pass the parameters sharded, with in_specs="
            "jaxpg.tensor_parallel.param_specs(state) (DDP and the pipeline do this)."
        )
    raise ValueError(f"{api}: {name} has shape {shape}; this rank's shard of {full} is {local}.")


def _host_out(y: jax.Array, layout: Placement, tp: MeshAxis, use_local_output: bool) -> jax.Array:
    y = to_global(y, layout, tp)
    return to_local(y, tp) if use_local_output else y


def column_parallel_linear(
    x: Any, kernel: Any, bias: Any, tp: MeshAxis, *, shape: tuple[int, int],
    input_layout: Placement = REPLICATE, output_layout: Placement = LAST_DIM,
    use_local_output: bool = True, matmul: Matmul = dense, api: str = "ColumnParallelLinear",
) -> jax.Array:
    """``x @ kernel + bias`` with ``kernel`` ``[in, out]`` split on ``out``.

    In SPMD code: a ``Replicate`` input passes Megatron's ``f`` (all-reduce of its gradient;
    shared across the module's column-parallel layers under ``PrepareModuleInput``), a
    ``Shard(d)`` input (sequence parallelism) is all-gathered with a reduce-scattered
    gradient; the local matmul gives ``Shard(-1)``, moved to ``output_layout``
    (``Replicate``: an all-gather). ``shape`` is the kernel's full ``(in, out)``.
    """
    if tp.in_spmd(api):
        n_in, n_out = shape
        check_local_shape(kernel, (n_in, n_out), (n_in, n_out // tp.size), "weight", api)
        if input_layout.is_replicate():
            twin = shared_twin(x)
            x = twin if twin is not None else ops.copy_to_tensor_parallel_region(x, tp.axis)
        else:
            x = redistribute_local(x, input_layout, Replicate(), tp.axis, partial_grad=True)
        y = _add_bias(matmul(x, kernel), bias)
        return redistribute_local(y, Shard(-1), output_layout, tp.axis)
    x = to_global(x, input_layout, tp)
    return _host_out(_add_bias(matmul(x, kernel), bias), output_layout, tp, use_local_output)


def row_parallel_linear(
    x: Any, kernel: Any, bias: Any, tp: MeshAxis, *, shape: tuple[int, int],
    input_layout: Placement = LAST_DIM, output_layout: Placement = REPLICATE,
    use_local_output: bool = True, matmul: Matmul = dense, api: str = "RowParallelLinear",
) -> jax.Array:
    """``x @ kernel + bias`` with ``kernel`` ``[in, out]`` split on ``in``.

    In SPMD code: the input is moved to ``Shard(-1)`` (a ``Replicate`` one is split, its
    gradient all-gathered), the local matmul gives partial sums, which are all-reduced
    (Megatron's ``g``, for ``Replicate``) or reduce-scattered (``Shard(d)``, sequence
    parallelism); the bias is added after the reduction. ``shape`` is the kernel's full
    ``(in, out)``.
    """
    if tp.in_spmd(api):
        n_in, n_out = shape
        check_local_shape(kernel, (n_in, n_out), (n_in // tp.size, n_out), "weight", api)
        x = redistribute_local(x, input_layout, Shard(-1), tp.axis)
        y = redistribute_local(matmul(x, kernel), Partial(), output_layout, tp.axis)
        if bias is not None and not output_layout.is_replicate():
            bias = ops.copy_to_tensor_parallel_region(bias, tp.axis)  # each rank adds it to
        return _add_bias(y, bias)  # its own chunk: the bias gradient is a partial sum
    x = to_global(x, input_layout, tp)
    return _host_out(_add_bias(matmul(x, kernel), bias), output_layout, tp, use_local_output)


def _take(table: jax.Array, ids: jax.Array, dtype: Any) -> jax.Array:
    (table,) = dtypes.promote_dtype((table,), dtype=dtype, inexact=False)
    return jnp.take(table, ids, axis=0)


def _check_ids(ids: Any, api: str) -> None:
    if not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
        raise ValueError(f"{api}: the input must hold integer token ids; got dtype "
                         f"{jnp.result_type(ids)}.")


def vocab_parallel_embedding(
    ids: Any, table: Any, tp: MeshAxis, *, shape: tuple[int, int],
    input_layout: Placement = REPLICATE, output_layout: Placement = REPLICATE,
    use_local_output: bool = True, dtype: Any = None, api: str = "VocabParallelEmbedding",
) -> jax.Array:
    """Embedding lookup with ``table`` ``[vocab, dim]`` split on the vocabulary.

    In SPMD code each rank looks up the ids in its range ``[rank * V/tp, (rank + 1) * V/tp)``
    and zeros the rest; the partial results are all-reduced (``Replicate``) or
    reduce-scattered (``Shard(d)``, sequence parallelism). ``shape`` is the table's full
    ``(vocab, dim)``.
    """
    _check_ids(ids, api)
    if tp.in_spmd(api):
        vocab, dim = shape
        per_part = vocab // tp.size
        check_local_shape(table, (vocab, dim), (per_part, dim), "weight", api)
        ids = redistribute_local(ids, input_layout, Replicate(), tp.axis)
        start = lax.axis_index(tp.axis) * per_part
        outside = (ids < start) | (ids >= start + per_part)
        out = _take(table, jnp.where(outside, 0, ids - start), dtype)
        out = jnp.where(outside[..., None], jnp.zeros((), out.dtype), out)
        return redistribute_local(out, Partial(), output_layout, tp.axis)
    ids = to_global(ids, input_layout, tp)
    return _host_out(_take(table, ids, dtype), output_layout, tp, use_local_output)


def column_parallel_embedding(
    ids: Any, table: Any, tp: MeshAxis, *, shape: tuple[int, int],
    input_layout: Placement = REPLICATE, output_layout: Placement = LAST_DIM,
    use_local_output: bool = True, dtype: Any = None, api: str = "ColwiseParallel(Embed)",
) -> jax.Array:
    """Embedding lookup with ``table`` ``[vocab, dim]`` (``shape``) split on the embedding
    dimension."""
    _check_ids(ids, api)
    if tp.in_spmd(api):
        vocab, dim = shape
        check_local_shape(table, (vocab, dim), (vocab, dim // tp.size), "weight", api)
        ids = redistribute_local(ids, input_layout, Replicate(), tp.axis)
        return redistribute_local(_take(table, ids, dtype), Shard(-1), output_layout, tp.axis)
    ids = to_global(ids, input_layout, tp)
    return _host_out(_take(table, ids, dtype), output_layout, tp, use_local_output)
