"""Tensor and sequence parallelism on the model-parallel axis: Paddle's mp layers and torch's
``parallelize_module`` plans for Flax NNX modules (see docs/tensor_parallel.md)."""

from jaxpg.tensor_parallel.cross_entropy import ParallelCrossEntropy, vocab_parallel_cross_entropy
from jaxpg.tensor_parallel.mappings import (
    all_to_all_region,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from jaxpg.tensor_parallel.mp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from jaxpg.tensor_parallel.parallelize import attach_plan, parallel_style_of, parallelize_module
from jaxpg.tensor_parallel.placements import Partial, Placement, Replicate, Shard
from jaxpg.tensor_parallel.prepare import (
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
)
from jaxpg.tensor_parallel.redistribute import to_global, to_local
from jaxpg.tensor_parallel.sequence_parallel import (
    ColumnSequenceParallelLinear,
    RowSequenceParallelLinear,
)
from jaxpg.tensor_parallel.sharded_params import distribute_tensor, local_shape, param_specs
from jaxpg.tensor_parallel.styles import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "ParallelCrossEntropy", "vocab_parallel_cross_entropy", "ColumnSequenceParallelLinear",
    "RowSequenceParallelLinear", "parallelize_module", "parallel_style_of", "attach_plan",
    "ParallelStyle",
    "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
    "PrepareModuleOutput", "PrepareModuleInputOutput", "Placement", "Shard", "Replicate",
    "Partial", "param_specs", "local_shape", "distribute_tensor",
    "to_global", "to_local", "copy_to_tensor_parallel_region",
    "reduce_from_tensor_parallel_region", "scatter_to_tensor_parallel_region",
    "gather_from_tensor_parallel_region", "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "all_to_all_region",
]
