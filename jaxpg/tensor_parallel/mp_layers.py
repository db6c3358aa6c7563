"""Paddle's model-parallel layers (``paddle.distributed.fleet.layers.mpu.mp_layers``) in NNX.

``ColumnParallelLinear``, ``RowParallelLinear`` and ``VocabParallelEmbedding`` take Paddle's
arguments and default to the model-parallel group of the latest HybridCommunicateGroup.
Each holds its weight as a global array of the full shape, sharded over the group (see
:mod:`~jaxpg.tensor_parallel.sharded_params`), so every rank holds only its shard: Paddle's
``[in, out/mp]``, ``[in/mp, out]`` and ``[vocab/mp, dim]``. Built with ``rngs=nnx.Rngs(s)``,
a layer holds exactly the matching slice of ``nnx.Linear``/``nnx.Embed`` built with the same
seed (same initializers, same key order), in both layouts.

Decisions where Paddle and JAX differ:

* ``weight_attr`` is an initializer ``init(key, shape, dtype)`` (Paddle's ``ParamAttr``
  initializer), or the full weight as an array (Paddle's ``NumpyArrayInitializer``), which
  every rank slices (tp rank 0's copy wins). Default: flax's initializers.
* Initialisation computes the full tensor on each process, as flax does (op by op), and
  each device keeps its slice, so the layer is bit-equal to the unsharded one. Paddle draws
  each rank's shard from its own seed instead; ``sharded_params.init_sharded`` computes
  only each device's shard (same values up to rounding) where host memory is short.
* ``fuse_matmul_bias`` is accepted and has no effect: XLA fuses the bias into the matmul.
* The forward runs in SPMD code with Megatron's collectives, or in host code on global
  arrays (see :mod:`~jaxpg.tensor_parallel.functional`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.linear import default_bias_init, default_embed_init, default_kernel_init
from jax.sharding import PartitionSpec as P

from jaxpg.groups.mesh_axis import MeshAxis, resolve_mesh_axis
from jaxpg.tensor_parallel import functional as F
from jaxpg.tensor_parallel.placements import Replicate, Shard
from jaxpg.tensor_parallel.sharded_params import check_divisible, distribute_tensor

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "make_param"]


def make_param(init: Any, default: Callable[..., Any], rngs: nnx.Rngs | None,
               shape: tuple[int, ...], dtype: Any, tp: MeshAxis, spec: P, api: str,
               name: str) -> nnx.Param:
    """A sharded parameter from an initializer (or a full array), as its layer's shard."""
    if init is not None and not callable(init):
        full = jnp.asarray(init) if not hasattr(init, "shape") else init
        if tuple(full.shape) != tuple(shape):
            raise ValueError(f"{api}: {name} was given as an array of shape {tuple(full.shape)}; "
                             f"the layer's {name} has shape {shape}.")
        if rngs is not None:
            rngs.params()  # the key the initializer would have used, for the same key order
        return nnx.Param(distribute_tensor(jnp.asarray(full, dtype), tp, spec))
    if rngs is None:
        raise TypeError(f"{api}: pass rngs=nnx.Rngs(seed) to initialise {name}, or the full "
                        f"{name} as weight_attr.")
    # The full tensor, computed as flax computes it (op by op; a jitted initializer can
    # round differently), then each device keeps its slice: bit-equal to the unsharded layer.
    full = (init or default)(rngs.params(), shape, dtype)
    return nnx.Param(distribute_tensor(full, tp, spec, src_data_rank=None))


class _ParallelLinear(nnx.Module):
    """What Column- and RowParallelLinear share: the weight, the bias and the matmul."""

    def _build(self, api: str, in_features: int, out_features: int, weight_attr: Any,
               has_bias: bool, mp_group: Any, name: str | None, rngs: nnx.Rngs | None,
               dtype: Any, param_dtype: Any, precision: Any, bias_init: Any,
               split: int, fuse_matmul_bias: bool) -> None:
        self.tp = resolve_mesh_axis(mp_group, "tp", api=api)
        check_divisible((in_features, out_features)[split], self.tp,
                        ("in_features", "out_features")[split], api)
        self.in_features, self.out_features = in_features, out_features
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
        self.fuse_matmul_bias = fuse_matmul_bias
        self.name = name
        spec = P(self.tp.axis, None) if split == 0 else P(None, self.tp.axis)
        self.weight = make_param(weight_attr, default_kernel_init, rngs,
                                 (in_features, out_features), param_dtype, self.tp, spec, api,
                                 "weight")
        self.bias: nnx.Param | None = nnx.data(None)
        if has_bias:
            bias_spec = P(self.tp.axis) if split == 1 else P()
            self.bias = make_param(bias_init, default_bias_init, rngs, (out_features,),
                                   param_dtype, self.tp, bias_spec, api, "bias")

    @property
    def world_size(self) -> int:
        """The model-parallel degree (Paddle's ``world_size``)."""
        return self.tp.size

    @property
    def is_mp(self) -> bool:
        return self.tp.size > 1

    def _matmul(self) -> Callable[..., Any]:
        return functools.partial(F.dense, dtype=self.dtype, precision=self.precision)

    def _bias(self) -> jax.Array | None:
        return None if self.bias is None else self.bias[...]

    def _shape(self) -> tuple[int, int]:
        return self.in_features, self.out_features


class ColumnParallelLinear(_ParallelLinear):
    """Linear layer with the weight ``[in, out]`` split on ``out`` (Paddle's columns).

    Forward: Megatron's ``f`` on the input (identity; the backward all-reduces), the local
    matmul, and with ``gather_output`` an all-gather of the output's last dimension.

    Args:
        in_features: input size.
        out_features: output size; the model-parallel degree must divide it.
        weight_attr: the weight's initializer, or the full weight as an array.
        has_bias: add a bias (split as the output; Paddle's default None means no bias).
        gather_output: all-gather the output (True), or return this rank's
            ``[..., out/mp]`` part for a RowParallelLinear with ``input_is_parallel``.
        fuse_matmul_bias: accepted for Paddle's API; XLA fuses the bias itself.
        mp_group: the tensor-parallel group; default: the HCG's model-parallel group.
        name: the layer's name.
        rngs: ``nnx.Rngs`` for the initializers.
        dtype: the computation dtype (None: from the inputs and parameters).
        param_dtype: the parameters' dtype.
        precision: the matmul precision.
        bias_init: the bias initializer (Paddle: zeros).
    """

    def __init__(self, in_features: int, out_features: int, weight_attr: Any = None,
                 has_bias: bool | None = None, gather_output: bool = True,
                 fuse_matmul_bias: bool = False, mp_group: Any = None, name: str | None = None,
                 *, rngs: nnx.Rngs | None = None, dtype: Any = None,
                 param_dtype: Any = jnp.float32, precision: Any = None,
                 bias_init: Any = None):
        self._build("ColumnParallelLinear", in_features, out_features, weight_attr,
                    bool(has_bias), mp_group, name, rngs, dtype, param_dtype, precision,
                    bias_init, 1, fuse_matmul_bias)
        self.gather_output = gather_output
        self.output_size_per_partition = out_features // self.tp.size

    def _layouts(self) -> tuple[Any, Any]:
        return Replicate(), Replicate() if self.gather_output else Shard(-1)

    def __call__(self, x: Any) -> jax.Array:
        input_layout, output_layout = self._layouts()
        return F.column_parallel_linear(
            x, self.weight[...], self._bias(), self.tp, shape=self._shape(),
            input_layout=input_layout,
            output_layout=output_layout, matmul=self._matmul(), api=type(self).__name__)


class RowParallelLinear(_ParallelLinear):
    """Linear layer with the weight ``[in, out]`` split on ``in`` (Paddle's rows).

    Forward: split the input's last dimension unless ``input_is_parallel``, the local
    matmul, an all-reduce of the partial sums (Megatron's ``g``), then the bias.

    Args:
        in_features: input size; the model-parallel degree must divide it.
        out_features: output size.
        weight_attr: the weight's initializer, or the full weight as an array.
        has_bias: add a (replicated) bias after the all-reduce.
        input_is_parallel: the input is already this rank's ``[..., in/mp]`` part.
        fuse_matmul_bias: accepted for Paddle's API; XLA fuses the bias itself.
        mp_group: the tensor-parallel group; default: the HCG's model-parallel group.
        name: the layer's name.
        rngs, dtype, param_dtype, precision, bias_init: as ``ColumnParallelLinear``.
    """

    def __init__(self, in_features: int, out_features: int, weight_attr: Any = None,
                 has_bias: bool = True, input_is_parallel: bool = False,
                 fuse_matmul_bias: bool = False, mp_group: Any = None, name: str | None = None,
                 *, rngs: nnx.Rngs | None = None, dtype: Any = None,
                 param_dtype: Any = jnp.float32, precision: Any = None,
                 bias_init: Any = None):
        self._build("RowParallelLinear", in_features, out_features, weight_attr,
                    bool(has_bias), mp_group, name, rngs, dtype, param_dtype, precision,
                    bias_init, 0, fuse_matmul_bias)
        self.input_is_parallel = input_is_parallel
        self.input_size_per_partition = in_features // self.tp.size

    @property
    def rank(self) -> int:
        """The acting rank's rank in the model-parallel group (host code)."""
        return self.tp.rank()

    def _layouts(self) -> tuple[Any, Any]:
        return Shard(-1) if self.input_is_parallel else Replicate(), Replicate()

    def __call__(self, x: Any) -> jax.Array:
        input_layout, output_layout = self._layouts()
        return F.row_parallel_linear(
            x, self.weight[...], self._bias(), self.tp, shape=self._shape(),
            input_layout=input_layout,
            output_layout=output_layout, matmul=self._matmul(), api=type(self).__name__)


class VocabParallelEmbedding(nnx.Module):
    """Embedding with the table ``[num_embeddings, embedding_dim]`` split on the vocabulary.

    Each rank looks up the ids in its range ``[rank * per_part, (rank + 1) * per_part)``
    (``vocab_start_index``), zeros the others, and the results are all-reduced.

    Args:
        num_embeddings: the vocabulary size; the model-parallel degree must divide it.
        embedding_dim: the embedding size.
        weight_attr: the table's initializer, or the full table as an array.
        mp_group: the tensor-parallel group; default: the HCG's model-parallel group.
        name: the layer's name.
        rngs: ``nnx.Rngs`` for the initializer.
        dtype: the output dtype (None: the table's).
        param_dtype: the table's dtype.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, weight_attr: Any = None,
                 mp_group: Any = None, name: str | None = None, *,
                 rngs: nnx.Rngs | None = None, dtype: Any = None,
                 param_dtype: Any = jnp.float32):
        api = "VocabParallelEmbedding"
        self.tp = resolve_mesh_axis(mp_group, "tp", api=api)
        check_divisible(num_embeddings, self.tp, "num_embeddings", api)
        self.origin_num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.per_part_size = num_embeddings // self.tp.size
        self.dtype, self.name = dtype, name
        self.weight = make_param(weight_attr, default_embed_init, rngs,
                                 (num_embeddings, embedding_dim), param_dtype, self.tp,
                                 P(self.tp.axis, None), api, "weight")

    @property
    def world_size(self) -> int:
        return self.tp.size

    @property
    def is_mp(self) -> bool:
        return self.tp.size > 1

    @property
    def rank(self) -> int:
        """The acting rank's rank in the model-parallel group (host code)."""
        return self.tp.rank()

    @property
    def vocab_start_index(self) -> int:
        """The first id of the acting rank's part of the vocabulary (host code)."""
        return self.rank * self.per_part_size

    def __call__(self, x: Any) -> jax.Array:
        return F.vocab_parallel_embedding(
            x, self.weight[...], self.tp, shape=(self.origin_num_embeddings, self.embedding_dim),
            dtype=self.dtype, api="VocabParallelEmbedding")
