"""torch's parallel styles for NNX modules: ColwiseParallel, RowwiseParallel, SequenceParallel.

A style is applied by :func:`~jaxpg.tensor_parallel.parallelize_module`: it checks the
module, replaces its parameters by sharded global arrays of the same values (torch's
``distribute_tensor`` from the full tensor) and from then on runs the module's call:

================  ==========================================  ==================  ===========
style             parameters                                  input (default)     output
================  ==========================================  ==================  ===========
ColwiseParallel   Linear kernel ``[in, out]`` split on out,   Replicate           Shard(-1)
                  its bias split; Embed table split on dim
RowwiseParallel   Linear kernel split on in, bias replicated; Shard(-1)           Replicate
                  Embed table split on the vocabulary
SequenceParallel  replicated (gradients summed over the       Shard(seq)          Shard(seq)
                  group)
================  ==========================================  ==================  ===========

``input_layouts`` says how the input *is* laid out, ``output_layouts`` how the output
should be, and ``use_local_output`` whether host code gets this process's local data
(True) or the global array (False, JAX's DTensor); inside SPMD code values are always
local. As torch, a Rowwise embedding's default input layout is ``Shard(-1)``: pass
``input_layouts=Replicate()`` for token ids that every rank holds.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpg.groups.mesh_axis import MeshAxis
from jaxpg.tensor_parallel import functional as F
from jaxpg.tensor_parallel import mappings as ops
from jaxpg.tensor_parallel.placements import Placement, Replicate, Shard, check_placement
from jaxpg.tensor_parallel.redistribute import to_global, to_local
from jaxpg.tensor_parallel.sharded_params import check_divisible

__all__ = ["ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel"]


class ParallelStyle:
    """How a module is parallelized (torch's ``ParallelStyle``). Subclasses define
    :meth:`param_specs` (where each parameter is split) and :meth:`call` (the forward)."""

    def check(self, module: nnx.Module, key: str, tp: MeshAxis) -> None:
        """Raises if ``module`` (at plan key ``key``) cannot take this style."""

    def param_specs(self, module: nnx.Module, tp: MeshAxis) -> dict[str, P]:
        """``{attribute name: PartitionSpec}`` for the parameters this style splits."""
        return {}

    def call(self, module: nnx.Module, original: Any, tp: MeshAxis, args: tuple,
             kwargs: dict) -> Any:
        """Runs ``module`` (``original`` is its class's own ``__call__``)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


def _linear_matmul(module: nnx.Linear) -> Any:
    return functools.partial(F.dense, dtype=module.dtype, precision=module.precision,
                             dot_general=module.dot_general, promote_dtype=module.promote_dtype)


def _kind(module: nnx.Module, style: str, key: str) -> str:
    if isinstance(module, nnx.Linear):
        return "linear"
    if isinstance(module, nnx.Embed):
        return "embed"
    raise TypeError(
        f"{style}: plan key {key!r} matches a {type(module).__name__}, which {style} cannot "
        "shard; it applies to nnx.Linear and nnx.Embed layers only (use SequenceParallel or "
        "PrepareModuleInput for other modules)."
    )


def _only_input(args: tuple, kwargs: dict, style: str) -> Any:
    extra = [k for k in kwargs if k != "out_sharding" or kwargs[k] is not None]
    if len(args) != 1 or extra:
        raise TypeError(f"{style}: the layer takes one input array; got {len(args)} positional "
                        f"and keyword arguments {sorted(kwargs)}.")
    return args[0]


class _LinearStyle(ParallelStyle):
    _name = ""
    _default_in: Placement = Replicate()
    _default_out: Placement = Replicate()

    def __init__(self, *, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True):
        api = type(self).__name__
        self.input_layouts = check_placement(input_layouts or self._default_in,
                                             "input_layouts", api)
        self.output_layouts = check_placement(output_layouts or self._default_out,
                                              "output_layouts", api)
        self.use_local_output = bool(use_local_output)

    def check(self, module: nnx.Module, key: str, tp: MeshAxis) -> None:
        kind = _kind(module, type(self).__name__, key)
        size, what = self._split_size(module, kind)
        check_divisible(size, tp, f"{key}.{what}", type(self).__name__)

    def _split_size(self, module: nnx.Module, kind: str) -> tuple[int, str]:
        raise NotImplementedError


class ColwiseParallel(_LinearStyle):
    """Splits a Linear's output features (an Embed's embedding dimension) over the group.

    Args:
        input_layouts: the input's placement (default ``Replicate()``; ``Shard(1)`` for
            sequence parallelism: the input is all-gathered, its gradient reduce-scattered).
        output_layouts: the output's placement (default ``Shard(-1)``; ``Replicate()``
            all-gathers it).
        use_local_output: in host code, return this process's local data (True) or the
            global array.
    """

    _default_in = Replicate()
    _default_out = Shard(-1)

    def _split_size(self, module, kind):
        return (module.out_features, "out_features") if kind == "linear" else (
            module.features, "features")

    def param_specs(self, module, tp):
        if isinstance(module, nnx.Linear):
            specs = {"kernel": P(None, tp.axis)}
            if module.bias is not None:
                specs["bias"] = P(tp.axis)
            return specs
        return {"embedding": P(None, tp.axis)}

    def call(self, module, original, tp, args, kwargs):
        x = _only_input(args, kwargs, "ColwiseParallel")
        common = dict(input_layout=self.input_layouts, output_layout=self.output_layouts,
                      use_local_output=self.use_local_output, api="ColwiseParallel")
        if isinstance(module, nnx.Linear):
            bias = None if module.bias is None else module.bias[...]
            return F.column_parallel_linear(x, module.kernel[...], bias, tp,
                                            shape=(module.in_features, module.out_features),
                                            matmul=_linear_matmul(module), **common)
        return F.column_parallel_embedding(x, module.embedding[...], tp, dtype=module.dtype,
                                           shape=(module.num_embeddings, module.features),
                                           **common)


class RowwiseParallel(_LinearStyle):
    """Splits a Linear's input features (an Embed's vocabulary) over the group.

    Args:
        input_layouts: the input's placement (default ``Shard(-1)``, a ColwiseParallel
            layer's output; ``Replicate()`` splits it; for an Embed, the token ids').
        output_layouts: the output's placement (default ``Replicate()``: the partial sums
            are all-reduced; ``Shard(1)`` reduce-scatters them, for sequence parallelism).
        use_local_output: in host code, return this process's local data (True) or the
            global array.
    """

    _default_in = Shard(-1)
    _default_out = Replicate()

    def _split_size(self, module, kind):
        return (module.in_features, "in_features") if kind == "linear" else (
            module.num_embeddings, "num_embeddings")

    def param_specs(self, module, tp):
        if isinstance(module, nnx.Linear):
            return {"kernel": P(tp.axis, None)}
        return {"embedding": P(tp.axis, None)}

    def call(self, module, original, tp, args, kwargs):
        x = _only_input(args, kwargs, "RowwiseParallel")
        common = dict(input_layout=self.input_layouts, output_layout=self.output_layouts,
                      use_local_output=self.use_local_output, api="RowwiseParallel")
        if isinstance(module, nnx.Linear):
            bias = None if module.bias is None else module.bias[...]
            return F.row_parallel_linear(x, module.kernel[...], bias, tp,
                                         shape=(module.in_features, module.out_features),
                                         matmul=_linear_matmul(module), **common)
        return F.vocab_parallel_embedding(x, module.embedding[...], tp, dtype=module.dtype,
                                          shape=(module.num_embeddings, module.features),
                                          **common)


def _with_summed_param_grads(module: nnx.Module, axis: str) -> nnx.Module:
    """A copy of ``module`` whose parameters pass Megatron's ``f`` (gradients all-reduced)."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    params = jax.tree.map(lambda p: ops.copy_to_tensor_parallel_region(p, axis), params)
    return nnx.merge(graphdef, params, rest)


def _per_rank_dropout_key(module: nnx.Dropout, kwargs: dict, axis: str) -> dict:
    """Dropout on a sequence chunk: the module's key folded with the tp rank, so each rank
    draws its own mask (Megatron's model-parallel RNG tracker), not copies of one."""
    deterministic = kwargs.get("deterministic")
    deterministic = module.deterministic if deterministic is None else deterministic
    source = kwargs.get("rngs")
    source = module.rngs if source is None else source
    if deterministic or module.rate == 0.0 or source is None:
        return kwargs
    if isinstance(source, nnx.Rngs):
        source = source[module.rng_collection]
    key = source() if callable(source) else source
    return {**kwargs, "rngs": jax.random.fold_in(key, jax.lax.axis_index(axis))}


class SequenceParallel(ParallelStyle):
    """Runs a per-token module (LayerNorm, RMSNorm, dropout) on this rank's sequence chunk.

    The input is taken as split along ``sequence_dim`` (as torch does for a plain tensor)
    and so is the output; the module's parameters stay replicated and, since each rank sees
    only its tokens, their gradients are all-reduced over the group (Megatron's
    sequence-parallel LayerNorm).

    Args:
        sequence_dim: the sequence dimension of the input and output (default 1).
        use_local_output: in host code, return this process's local data (True) or the
            global array (False, torch's default for this style).
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        self.sequence_dim = int(sequence_dim)
        self.use_local_output = bool(use_local_output)

    def call(self, module, original, tp, args, kwargs):
        if not args:
            raise TypeError("SequenceParallel: the module takes its input as the first "
                            "positional argument.")
        layout = Shard(self.sequence_dim)
        if tp.in_spmd("SequenceParallel"):
            if isinstance(module, nnx.Dropout):
                kwargs = _per_rank_dropout_key(module, kwargs, tp.axis)
            copy = _with_summed_param_grads(module, tp.axis)
            out = original(copy, *args, **kwargs)
            nnx.update(module, nnx.state(copy, nnx.Not(nnx.Param)))  # RNG counters etc.
            return out
        x = to_global(args[0], layout, tp)
        out = to_global(original(module, x, *args[1:], **kwargs), layout, tp)
        return to_local(out, tp) if self.use_local_output else out
