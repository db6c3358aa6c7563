"""DistributedDataParallel building blocks: bucket plans, the reducer, hooks, sampler."""

from jaxpg.ddp.bucket_plan import Bucket, BucketPlan, make_bucket_plan
from jaxpg.ddp.comm_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
    make_comm_hook,
    noop_hook,
)
from jaxpg.ddp.grad_bucket import GradBucket
from jaxpg.ddp.powersgd import (
    PowerSGDConfig,
    PowerSGDState,
    init_powerSGD_state,
    powerSGD_compression_stats,
    powerSGD_hook,
)
from jaxpg.ddp.reducer import fused_pmean, reduce_gradients
from jaxpg.ddp.sampler import DistributedSampler

__all__ = [
    "Bucket",
    "BucketPlan",
    "DistributedSampler",
    "GradBucket",
    "PowerSGDConfig",
    "PowerSGDState",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
    "fused_pmean",
    "init_powerSGD_state",
    "make_bucket_plan",
    "make_comm_hook",
    "noop_hook",
    "powerSGD_compression_stats",
    "powerSGD_hook",
    "reduce_gradients",
]
