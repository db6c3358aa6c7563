"""Published training runs the planner is checked against (tests/plan, docs/planner.md).

``MEGATRON_TABLE1``: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM" (arXiv 2104.04473), Table 1: GPT models on A100 80GB
(Selene: 8 per node, NVLink within, 8 x 200 Gb/s InfiniBand per node), sequence 2048,
vocabulary 51,200, full recomputation, mixed precision. Each row: the preset, tensor- and
pipeline-parallel degrees, GPUs, batch (sequences), the achieved teraFLOP/s per GPU, and the
parameter count (billions) and aggregate petaFLOP/s as the table prints them (two columns
that check the others: the preset's size, and teraFLOP/s per GPU times GPUs).

The paper counts FLOPs with recomputation (its eq. 3): ``96 B s l h^2 (1 + s / (6 h) +
V / (16 l h))`` per step, so the published figure converts to tokens/s per GPU as
:func:`megatron_tokens_per_s`. The table gives no microbatch size; the planner assumes one
sequence per microbatch and the plain 1F1B schedule.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxpg.plan.spec import TransformerSpec

__all__ = ["MEGATRON_TABLE1", "PublishedRun", "megatron_flops_per_token",
           "megatron_tokens_per_s"]


class PublishedRun(NamedTuple):
    model: str
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops_per_gpu: float
    params_billion: float
    aggregate_pflops: float

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


MEGATRON_TABLE1 = (
    PublishedRun("gpt-1.7b", 1, 1, 32, 512, 137, 1.7, 4.4),
    PublishedRun("gpt-3.6b", 2, 1, 64, 512, 138, 3.6, 8.8),
    PublishedRun("gpt-7.5b", 4, 1, 128, 512, 142, 7.5, 18.2),
    PublishedRun("gpt-18b", 8, 1, 256, 1024, 135, 18.4, 34.6),
    PublishedRun("gpt-39b", 8, 2, 512, 1536, 138, 39.1, 70.8),
    PublishedRun("gpt-76b", 8, 4, 1024, 1792, 140, 76.1, 143.8),
    PublishedRun("gpt-146b", 8, 8, 1536, 2304, 148, 145.6, 227.1),
    PublishedRun("gpt-310b", 8, 16, 1920, 2160, 155, 310.1, 297.4),
    PublishedRun("gpt-530b", 8, 35, 2520, 2520, 163, 529.6, 410.2),
    PublishedRun("gpt-1t", 8, 64, 3072, 3072, 163, 1008.0, 502.0),
)


def megatron_flops_per_token(spec: TransformerSpec, seq_len: int = 2048) -> float:
    """The paper's FLOPs per token of a step, recomputation included (its eq. 3 / (B s))."""
    layers, h, v = spec.layers, spec.dim, spec.vocab
    return 96.0 * layers * h * h * (1 + seq_len / (6 * h) + v / (16 * layers * h))


def megatron_tokens_per_s(run: PublishedRun, spec: TransformerSpec) -> float:
    """The published throughput as tokens/s per GPU."""
    return run.tflops_per_gpu * 1e12 / megatron_flops_per_token(spec)
