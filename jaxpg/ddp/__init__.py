"""DistributedDataParallel: bucket plans, the reducer, hooks, the DDP wrapper and its step,
join, SyncBatchNorm, checkpoints, the sampler and the host-side ZeroRedundancyOptimizer."""

from jaxpg.ddp.bucket_plan import Bucket, BucketPlan, make_bucket_plan
from jaxpg.ddp.checkpoint import (
    latest_step,
    restore_checkpoint,
    save_checkpoint,
    wait_for_checkpoints,
)
from jaxpg.ddp.comm_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
    make_comm_hook,
    noop_hook,
)
from jaxpg.ddp.distributed import DistributedDataParallel
from jaxpg.ddp.grad_bucket import GradBucket
from jaxpg.ddp.join import Join
from jaxpg.ddp.param_sync import verify_param_shapes
from jaxpg.ddp.powersgd import (
    PowerSGDConfig,
    PowerSGDState,
    init_powerSGD_state,
    powerSGD_compression_stats,
    powerSGD_hook,
)
from jaxpg.ddp.reducer import reduce_gradients
from jaxpg.ddp.sampler import DistributedSampler
from jaxpg.ddp.sync_batchnorm import convert_sync_batchnorm, sync_batchnorm_axis
from jaxpg.ddp.zero_optimizer import ZeroRedundancyOptimizer

__all__ = [
    "Bucket",
    "BucketPlan",
    "DistributedDataParallel",
    "DistributedSampler",
    "GradBucket",
    "Join",
    "PowerSGDConfig",
    "PowerSGDState",
    "ZeroRedundancyOptimizer",
    "allreduce_hook",
    "bf16_compress_hook",
    "convert_sync_batchnorm",
    "fp16_compress_hook",
    "init_powerSGD_state",
    "latest_step",
    "make_bucket_plan",
    "make_comm_hook",
    "noop_hook",
    "powerSGD_compression_stats",
    "powerSGD_hook",
    "reduce_gradients",
    "restore_checkpoint",
    "save_checkpoint",
    "sync_batchnorm_axis",
    "verify_param_shapes",
    "wait_for_checkpoints",
]
