"""Sharded data parallelism: ZeRO stages 1 to 3 and torch FSDP2's ``fully_shard`` for
Flax NNX and optax, HSDP, mixed precision, and sharded checkpoints that reshard on load.

See ``docs/fsdp.md``. DDP's ZeRO-1 switch is ``DistributedDataParallel(...,
shard_optimizer_state=True)`` (:mod:`jaxpg.ddp.zero`).
"""

from jaxpg.fsdp.fully_sharded import FullyShardedDataParallel
from jaxpg.fsdp.mixed_precision import MixedPrecisionPolicy

__all__ = ["FullyShardedDataParallel", "MixedPrecisionPolicy"]
