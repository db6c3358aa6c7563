"""Per-device memory of a layout: parameters, gradients, optimizer state, activations.

* **Model state** per parameter (mixed precision, Adam): a working copy in the compute dtype
  (when it differs from ``param_dtype``), fp32 master weights, gradients in ``grad_dtype``
  and two fp32 moments: 2 + 4 + 4 + 8 = 18 bytes, as Megatron-LM counts. ZeRO stage 1 shards
  the master weights and moments over ``dp_shard x cp``, stage 2 also the gradients, stage 3
  (FSDP) also the working copy. Routed experts are split over ``ep x tp`` and sharded over
  what is left of ``dp_shard x cp`` after ``ep``.
* **Parameters per device**: the blocks of the largest stage (``layers / pp``) over tp, plus
  the embedding on the first stage and the output head on the last.
* **Activations**: a block's saved bytes (:mod:`jaxpg.plan.activations`) times the blocks of a
  chunk times the chunks the schedule keeps in flight on its fullest rank (the pipeline's
  :func:`~jaxpg.pipeline.schedule.checker.default_in_flight_limits`: ``p`` for 1F1B's first stage,
  ``m`` for GPipe, Megatron's interleaved warmup, which gives Korthikanti's first-stage factor
  ``1 + (p - 1) / (p v)``).
* **Temporaries**: the last stage's logits (compute dtype and fp32) for one microbatch, one
  block recomputed at a time (full recomputation), and under ZeRO-3 two blocks' gathered
  parameters (the prefetch) with one block's unsharded gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types

from jaxpg.plan.activations import attention_core_bytes, block_activation_bytes
from jaxpg.plan.job import DTYPE_BYTES, Job
from jaxpg.plan.layout import Layout

__all__ = ["Memory", "ParamSplit", "in_flight_chunks", "memory", "moe_buffer_rows", "param_split",
           "timetable"]

GIB = 2.0**30


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device, by kind."""

    params: float
    grads: float
    optimizer: float
    activations: float
    temporaries: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.temporaries

    @property
    def total_gib(self) -> float:
        return self.total / GIB

    def as_gib(self) -> dict[str, float]:
        d = {k: v / GIB for k, v in dataclasses.asdict(self).items()}
        d["total"] = self.total_gib
        return d


@dataclasses.dataclass(frozen=True)
class ParamSplit:
    """Parameters on the fullest device, before ZeRO: dense (every ep rank) and routed."""

    dense: float
    experts: float
    block_dense: float     # one block's dense parameters on one device (over tp)
    block_experts: float   # one MoE block's routed experts on one device (over ep x tp)
    layers_per_stage: float
    moe_fraction: float    # the share of a stage's blocks that are MoE
    ends: float = 0.0      # the embedding and output head's share of ``dense``

    @property
    def total(self) -> float:
        return self.dense + self.experts


def param_split(job: Job, layout: Layout) -> ParamSplit:
    """The largest stage's parameters on one of its devices."""
    s, tp, pp = job.model, layout.tp, layout.pp
    per_stage = math.ceil(s.layers / (pp * layout.chunks)) * layout.chunks
    moe_fraction = s.moe_layers / s.layers
    dense_layers = s.layers - s.moe_layers
    body_dense = (dense_layers * s.dense_block_params
                  + s.moe_layers * s.shared_params_per_moe_layer) * per_stage / s.layers
    embed = s.vocab * s.dim
    if pp == 1:
        ends = s.embedding_params
    else:  # the first stage holds the embedding, the last the head (a copy of it when tied)
        ends = embed + s.dim
    dense = (body_dense + ends) / tp
    experts = s.routed_expert_params * per_stage / s.layers / (layout.ep * tp)
    block_dense = (s.dense_block_params if moe_fraction < 1
                   else s.shared_params_per_moe_layer) / tp
    block_experts = s.experts * s.expert_params / (layout.ep * tp)
    return ParamSplit(dense, experts, block_dense, block_experts, per_stage, moe_fraction,
                      ends / tp)


@functools.lru_cache(maxsize=4096)
def timetable(schedule: str, pp: int, microbatches: int, chunks: int):
    """The pipeline's timetable (cached): :func:`jaxpg.pipeline.schedule.builders.get_schedule`."""
    from jaxpg.pipeline.schedule.builders import get_schedule

    v = chunks if schedule in ("interleaved_1f1b", "zb_v") else 1
    return get_schedule(schedule, pp, microbatches, v)


def in_flight_chunks(layout: Layout) -> int:
    """Chunk activations the fullest pipeline rank holds at once (1 without a pipeline).

    The schedule's own promise (:func:`~jaxpg.pipeline.schedule.checker.default_in_flight_limits`,
    which reads only the timetable's name and sizes, so none is built here); it equals the
    count :func:`~jaxpg.pipeline.schedule.checker.peak_in_flight` reads off the timetable.
    """
    if layout.pp == 1:
        return 1
    from jaxpg.pipeline.schedule.checker import default_in_flight_limits

    sizes = types.SimpleNamespace(name=layout.schedule, num_stages=layout.pp,
                                  num_microbatches=layout.microbatches,
                                  num_chunks=layout.chunks)
    return max(default_in_flight_limits(sizes))


def _state_bytes(job: Job) -> tuple[int, int, int, int]:
    """(working copy, master, gradient, optimizer state) bytes per parameter."""
    working = DTYPE_BYTES[job.dtype] if job.dtype != job.param_dtype else 0
    return (working, DTYPE_BYTES[job.param_dtype], DTYPE_BYTES[job.grad_dtype],
            job.optimizer_states * 4)


def microbatch_size(job: Job, layout: Layout) -> float:
    """Sequences per microbatch on one data-parallel replica."""
    return job.global_batch / (layout.dp * layout.microbatches)


def moe_buffer_rows(job: Job, layout: Layout, tokens: float) -> tuple[float, float]:
    """``(grouped, per_pair)``: the rows of the buffer one MoE block's experts run on, and
    of each pair's part of the exchange's buffers, for ``tokens`` tokens on a device, as
    :func:`jaxpg.expert_parallel.moe` sizes them (its static shapes, dropless).

    The experts' buffer holds the worst case, ``ep · tokens · min(top_k, E / ep)`` rows;
    the exchange first tries ``ceil(1.25 · tokens · top_k / ep)`` rows per pair (the
    worst case's ``tokens · min(top_k, E / ep)`` where that is not smaller, and at ep = 1),
    the rule of ``jaxpg.expert_parallel.dispatch.first_try_rows`` at ``moe``'s default
    ``buffer_factor``. It is written here rather than imported, because that module needs jax,
    and the planner plans specs without it. ``tests/plan/test_plan_trial.py`` reads both
    sizes back from a trial step's program.
    """
    s = job.model
    worst = tokens * min(s.top_k, s.experts // layout.ep)
    first = -(-1.25 * tokens * s.top_k // layout.ep)
    return layout.ep * worst, (first if layout.ep > 1 and first < worst else worst)


def block_bytes(job: Job, layout: Layout, remat: str, *, moe: bool,
                buffers: bool = True) -> float:
    """One block's saved activation bytes per microbatch on one device; an MoE block's
    experts on the rows of their dispatch buffer (:func:`moe_buffer_rows`), or with
    ``buffers=False`` on the routed ``tokens · top_k`` only."""
    tokens = microbatch_size(job, layout) * job.seq_len / layout.cp
    rows = moe_buffer_rows(job, layout, tokens)[0] if moe and buffers else None
    return block_activation_bytes(job.model, moe=moe, tokens=tokens, seq_len=job.seq_len,
                                  tp=layout.tp, sp=layout.sp, remat=remat, act=job.act_bytes,
                                  expert_rows=rows,
                                  fused_experts=job.hardware.fused_expert_mlp)


def _mean_block_bytes(job: Job, layout: Layout, remat: str, moe_fraction: float) -> float:
    dense = block_bytes(job, layout, remat, moe=False) if moe_fraction < 1 else 0.0
    moe = block_bytes(job, layout, remat, moe=True) if moe_fraction > 0 else 0.0
    return dense * (1 - moe_fraction) + moe * moe_fraction


def memory(job: Job, layout: Layout) -> Memory:
    """The predicted memory of one device (the fullest) under ``layout``."""
    split = param_split(job, layout)
    working, master, grad, opt = _state_bytes(job)
    d_dense = layout.zero_group
    d_expert = max(1, layout.zero_group // layout.ep) if layout.zero else 1
    z = layout.zero

    def sharded(count_dense: float, count_exp: float, shard: bool) -> float:
        return (count_dense / d_dense + count_exp / d_expert) if shard else (
            count_dense + count_exp)

    n_d, n_e = split.dense, split.experts
    keep = working or master  # the copy the step computes with
    params = keep * sharded(n_d, n_e, z >= 3)
    if working:
        params += master * sharded(n_d, n_e, z >= 1)
    grads = grad * sharded(n_d, n_e, z >= 2)
    optimizer = opt * sharded(n_d, n_e, z >= 1)

    chunk_blocks = split.layers_per_stage / layout.chunks
    in_flight = in_flight_chunks(layout)
    activations = in_flight * chunk_blocks * _mean_block_bytes(
        job, layout, layout.remat, split.moe_fraction)
    tokens = microbatch_size(job, layout) * job.seq_len / layout.cp
    activations += in_flight / layout.chunks * tokens * job.model.dim * job.act_bytes / (
        layout.tp if layout.sp else 1)  # the embedding's output, each microbatch in flight

    temporaries = tokens * job.model.vocab / layout.tp * (job.act_bytes + 4)  # the logits
    moe = split.moe_fraction > 0.5
    if layout.remat == "full":
        temporaries += block_bytes(job, layout, "none", moe=moe)
    elif layout.remat == "selective":
        temporaries += attention_core_bytes(job.model, tokens=tokens, seq_len=job.seq_len,
                                            tp=layout.tp, act=job.act_bytes)
    if z >= 3:
        block = split.block_dense + (split.block_experts if moe else 0.0)
        temporaries += 2 * block * keep + block * grad
    return Memory(params, grads, optimizer, activations, temporaries)


def fits(job: Job, mem: Memory) -> bool:
    return mem.total <= job.hardware.usable_bytes and math.isfinite(mem.total)
