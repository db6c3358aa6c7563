"""Sharded data parallelism: ZeRO stages 1 to 3 and torch FSDP2's ``fully_shard`` for
Flax NNX and optax, HSDP, mixed precision, sharded checkpoints that reshard on load, and
ZeRO-1/2 inside pipeline stages (:mod:`jaxpg.pipeline.zero`, in the pipeline's layer above).

See ``docs/fsdp.md``. DDP's ZeRO-1 switch is ``DistributedDataParallel(...,
zero_stage=1)`` (:mod:`jaxpg.data_parallel.zero`).
"""

from jaxpg.fsdp.checkpoint import (
    consolidate_checkpoint,
    latest_step,
    restore_checkpoint,
    save_checkpoint,
    wait_for_checkpoints,
)
from jaxpg.fsdp.fully_sharded import FullyShardedDataParallel
from jaxpg.fsdp.memory import StepMemory, step_memory
from jaxpg.fsdp.mixed_precision import MixedPrecisionPolicy

__all__ = [
    "FullyShardedDataParallel",
    "MixedPrecisionPolicy",
    "StepMemory",
    "consolidate_checkpoint",
    "latest_step",
    "restore_checkpoint",
    "save_checkpoint",
    "step_memory",
    "wait_for_checkpoints",
]
