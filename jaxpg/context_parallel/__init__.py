"""Context parallelism: attention over a sequence split across a ``cp`` axis (ring,
all-to-all (Ulysses) and all-gather), the sequence layout helpers, and an NNX attention
layer, and the ``SequenceSplit`` that DDP and FSDP take as ``context_parallel=`` (see
docs/context_parallel.md)."""

from jaxpg.context_parallel.attention import attention
from jaxpg.context_parallel.layer import ContextParallelAttention
from jaxpg.context_parallel.sequence import (
    SequenceLayout,
    SequenceShards,
    shard_sequence,
    unshard_sequence,
)
from jaxpg.context_parallel.sequence_split import SequenceSplit

__all__ = [
    "attention", "SequenceLayout", "SequenceShards",
    "shard_sequence", "unshard_sequence", "ContextParallelAttention", "SequenceSplit",
]
