"""Paddle's sequence-parallel linears (``fleet.utils.sequence_parallel_utils``) in NNX.

Megatron's sequence parallelism: between the tensor-parallel regions, activations (and the
LayerNorm and dropout that act on them) are split along the sequence. A
``ColumnSequenceParallelLinear`` all-gathers the sequence before its matmul (backward: a
reduce-scatter of the input gradient); a ``RowSequenceParallelLinear`` reduce-scatters its
partial sums along the sequence (backward: an all-gather). Paddle's activations are
sequence-first (``[s, b, h]``), so ``sequence_dim`` defaults to 0; pass 1 for
batch-first.

Parameters of the sequence-parallel regions in between (a LayerNorm's scale and bias) see
only this rank's tokens, so their gradients must be summed over the group: mark those
modules with ``parallelize_module(model, group, {"ln": SequenceParallel(sequence_dim=0)})``
(Paddle's ``mark_as_sequence_parallel_parameter``).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxpg.tensor_parallel.mp_layers import ColumnParallelLinear, RowParallelLinear
from jaxpg.tensor_parallel.placements import Shard

__all__ = ["ColumnSequenceParallelLinear", "RowSequenceParallelLinear"]


class ColumnSequenceParallelLinear(ColumnParallelLinear):
    """A ColumnParallelLinear whose input is split along ``sequence_dim``.

    Arguments as ``ColumnParallelLinear``, and ``sequence_dim`` (0: Paddle's ``[s, b, h]``).
    ``gather_output`` must be False (the output stays split on its last dimension, for a
    RowSequenceParallelLinear).
    """

    def __init__(self, in_features: int, out_features: int, weight_attr: Any = None,
                 has_bias: bool | None = None, gather_output: bool = False,
                 fuse_matmul_bias: bool = False, mp_group: Any = None, name: str | None = None,
                 *, sequence_dim: int = 0, rngs: nnx.Rngs | None = None, dtype: Any = None,
                 param_dtype: Any = jnp.float32, precision: Any = None,
                 bias_init: Any = None):
        if gather_output:
            raise ValueError("ColumnSequenceParallelLinear: gather_output=True is not possible "
                             "with sequence parallelism; the output stays split on its last "
                             "dimension (pass gather_output=False).")
        super().__init__(in_features, out_features, weight_attr, has_bias, False,
                         fuse_matmul_bias, mp_group, name, rngs=rngs, dtype=dtype,
                         param_dtype=param_dtype, precision=precision, bias_init=bias_init)
        self.sequence_dim = sequence_dim

    def _layouts(self) -> tuple[Any, Any]:
        return Shard(self.sequence_dim), Shard(-1)


class RowSequenceParallelLinear(RowParallelLinear):
    """A RowParallelLinear whose output is reduce-scattered along ``sequence_dim``.

    Arguments as ``RowParallelLinear``, and ``sequence_dim``; ``input_is_parallel`` must be
    True (the input is a column-parallel layer's split output).
    """

    def __init__(self, in_features: int, out_features: int, weight_attr: Any = None,
                 has_bias: bool = True, input_is_parallel: bool = True,
                 fuse_matmul_bias: bool = False, mp_group: Any = None, name: str | None = None,
                 *, sequence_dim: int = 0, rngs: nnx.Rngs | None = None, dtype: Any = None,
                 param_dtype: Any = jnp.float32, precision: Any = None,
                 bias_init: Any = None):
        if not input_is_parallel:
            raise ValueError("RowSequenceParallelLinear: input_is_parallel=False is not "
                             "possible with sequence parallelism; feed it the split output of "
                             "a ColumnSequenceParallelLinear (input_is_parallel=True).")
        super().__init__(in_features, out_features, weight_attr, has_bias, True,
                         fuse_matmul_bias, mp_group, name, rngs=rngs, dtype=dtype,
                         param_dtype=param_dtype, precision=precision, bias_init=bias_init)
        self.sequence_dim = sequence_dim

    def _layouts(self) -> tuple[Any, Any]:
        return Shard(-1), Shard(self.sequence_dim)
