"""Predicted step time of a layout: compute, exposed communication, the pipeline's bubble.

Each pipeline action (one microbatch through one chunk of blocks on one rank) is priced:

* **compute**: matmul and attention FLOPs over ``peak x matmul_efficiency``, plus the
  elementwise work (norms, activations, softmax, dropout), which is bound by HBM bandwidth:
  each saved activation byte is written once and read once. The backward costs twice the
  forward; full recomputation adds a forward, selective recomputation attention's core.
  Fused (flash) attention skips the masked half of the causal scores. An MoE block also
  moves its dispatch buffers, sized as ``jaxpg.expert_parallel.moe`` sizes them (the
  worst case's rows for the experts, the first try's for the exchange), through HBM
  (:func:`moe_buffer_bytes`).
* **operations**: each kernel pays ``Hardware.op_overhead`` beyond its work. A block's
  forward runs a kernel for each of its matmuls (the weights' and attention's two) and one
  elementwise kernel after each, two for each norm and four for the mask and softmax (an
  MoE block six more: the router, its softmax, the top-k, dispatch, combine, the grouped
  matmul); the backward twice the forward's, recomputation the forward's (selective:
  attention core's six) again.
* **tensor parallelism** (exposed, as Megatron-LM runs it): two all-reduces (or all-gather +
  reduce-scatter with sequence parallelism, the same bytes) of the block's activations in the
  forward and two in the backward, two more when the backward recomputes the forward.
* **context parallelism**: the ring passes each rank's keys and values ``cp - 1`` times
  (twice that in the backward), overlapped with attention; only the excess is exposed.
* **expert parallelism** (exposed): an all-to-all to dispatch and one to combine, per MoE
  block and direction.
* **the pipeline**: one activation send per action (exposed); ZeRO-3's parameter all-gathers
  (forward and backward) and gradient reduce-scatters run ahead (prefetch), so only what
  exceeds the action's compute is exposed, plus the first block's; each parameter tensor
  is its own collective and pays the link's latency.

The actions' costs then play through the schedule's timetable with jaxpg's own event-driven
replay (:func:`jaxpg.pipeline.schedule.costs.timed`): its makespan minus the ranks' work is the
bubble. After the pipeline: the data-parallel gradient reduction (overlapped with the last
backward when ``overlap_grad_reduce``: only the excess over it, or one bucket, is exposed),
ZeRO's parameter all-gather, and the optimizer's pass over its state (HBM bound, three
kernels a parameter tensor); with several microbatches, the gradients' accumulation: each
microbatch after the first adds its gradients into the accumulator (read both, write one:
HBM bound, a kernel a tensor). On
hardware that runs one operation at a time (``Hardware.overlap`` False: XLA:CPU) nothing
hides: every collective is exposed.
"""

from __future__ import annotations

import dataclasses
import functools

from jaxpg.plan.job import DTYPE_BYTES, Job
from jaxpg.plan.layout import Layout
from jaxpg.plan.links import axis_link, collective_time
from jaxpg.plan.memory import (
    block_bytes,
    microbatch_size,
    moe_buffer_rows,
    param_split,
    timetable,
)

__all__ = ["EXPERT_TILE_ROWS", "StepTime", "block_kernels", "expert_tile_rows", "moe_buffer_bytes",
           "step_time"]


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on the slowest rank, by where they go."""

    compute: float
    exposed_comm: float
    bubble: float
    optimizer: float  # the optimizer's pass and the gradients' accumulation
    comm: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.compute + self.exposed_comm + self.bubble + self.optimizer


@dataclasses.dataclass(frozen=True)
class _Action:
    compute: float
    comm: dict[str, float]

    @property
    def total(self) -> float:
        return self.compute + sum(self.comm.values())


_CORE_KERNELS = 6  # QK^T, AV, the mask, softmax's max, exp-sum and division
_HEAD_KERNELS = 9  # the embedding's gather, the final norm, the head's matmul, log-softmax,
# the labels' gather and the mean
_OPTIMIZER_KERNELS = 3  # per parameter tensor: two moments and the update


def block_kernels(spec, *, moe: bool) -> int:
    """The kernels of one block's forward: a matmul's and an elementwise one for each weight
    matrix and each of attention's two matmuls, two per norm, the mask and softmax (and an
    MoE block's routing)."""
    matmuls = 4 + (3 if spec.mlp == "swiglu" else 2) + 2
    return 2 * matmuls + 2 * 2 + 4 + (6 if moe else 0)


def moe_buffer_bytes(job: Job, layout: Layout, tokens: float) -> float:
    """HBM bytes one MoE block's forward moves through the dispatch buffers
    (:func:`moe_buffer_rows`) beyond its tokens' own activations: the experts' buffer's
    zero fill, the scatter into it and the combine's gather out of it (four passes of
    ``dim``-wide rows), its rows past the routed ``tokens · top_k`` through the hidden
    layer (the first matmul's output, the activation read and written, the second matmul's
    read: four passes of ``expert_ffn``-wide rows; one, the pre-activations' zero fill,
    where the experts' MLP is one tiled loop over the routed rows,
    ``Hardware.fused_expert_mlp``), and the send and receive buffers of each direction,
    ``ep · per_pair`` rows, filled, exchanged and read (eight passes).
    """
    s = job.model
    grouped, per_pair = moe_buffer_rows(job, layout, tokens)
    padded = max(0.0, grouped - tokens * s.top_k)
    hidden_passes = 1.0 if job.hardware.fused_expert_mlp else 4.0
    return job.act_bytes * (hidden_passes * padded * s.expert_ffn / layout.tp
                            + 4.0 * grouped * s.dim + 8.0 * layout.ep * per_pair * s.dim)


EXPERT_TILE_ROWS = 128  # jaxpg.expert_parallel.grouped_matmul.TILE_ROWS, the Mosaic block_m


def expert_tile_rows(job: Job, layout: Layout, tokens: float) -> float:
    """The rows one device's experts multiply for ``tokens`` tokens: the routed
    ``tokens · top_k`` (balanced over the ep ranks) in tiles of ``EXPERT_TILE_ROWS``, each
    local expert's rows starting a tile of their own, so up to ``E / ep − 1`` partial tiles
    more than the rows fill. jaxpg's tiled loop and the Mosaic kernels both work so; it is
    written here rather than imported (that module needs jax, and specs plan without it)."""
    s = job.model
    routed = tokens * s.top_k
    tiles = -(-routed // EXPERT_TILE_ROWS) + s.experts // layout.ep - 1
    return max(routed, EXPERT_TILE_ROWS * tiles)


def _block_compute(job: Job, layout: Layout, *, moe: bool) -> tuple[float, float, float]:
    """(forward seconds, attention-core forward seconds, gemm seconds) of one block."""
    s, hw = job.model, job.hardware
    tokens = microbatch_size(job, layout) * job.seq_len / layout.cp
    width = min(s.dim, s.head_dim * max(1, s.kv_heads // layout.tp), tokens,
                (s.expert_ffn if moe else s.ffn) / layout.tp)
    rate = hw.matmul_rate(job.dtype, width)
    gemm = 2.0 * tokens * s.block_matmul_params(moe) / layout.tp / rate
    if moe:  # the experts' partial tiles (expert_tile_rows), beyond the routed rows
        extra = expert_tile_rows(job, layout, tokens) - tokens * s.top_k
        gemm += 2.0 * extra * s.expert_params / layout.tp / rate
    attn_flops = s.attention_flops_per_token(job.seq_len) * tokens / layout.tp
    if s.flash_attention:
        attn_flops *= 0.5  # causal: the fused kernel skips the masked blocks
    attn = attn_flops / rate
    # the tokens' own activations (the buffers' rows past them: moe_buffer_bytes)
    saved = block_bytes(job, layout, "none", moe=moe, buffers=False)
    core_saved = saved - block_bytes(job, layout, "selective", moe=moe, buffers=False)
    traffic = (2.0 * saved + (moe_buffer_bytes(job, layout, tokens) if moe else 0.0)
               ) / hw.hbm_bandwidth
    core = attn + 2.0 * core_saved / hw.hbm_bandwidth
    return gemm + attn + traffic, core, gemm


def _prefetched(comm: float, compute: float, blocks: float, overlap: bool) -> float:
    """What a prefetched collective leaves exposed: its excess over the compute it runs
    beside, plus the first block's share (nothing to hide behind); all of it without
    overlap."""
    if not overlap:
        return comm
    return max(0.0, comm - compute) + comm / max(blocks, 1)


def _actions(job: Job, layout: Layout) -> tuple[_Action, _Action, _Action | None]:
    """The F, B (and W) actions of one chunk on the slowest rank."""
    s, hw = job.model, job.hardware
    eff, dpn = hw.collective_efficiency, job.devices_per_node
    split = param_split(job, layout)
    blocks = split.layers_per_stage / layout.chunks
    frac = split.moe_fraction
    fwd_d, core_d, gemm_d = _block_compute(job, layout, moe=False)
    fwd_m, core_m, gemm_m = _block_compute(job, layout, moe=True) if frac else (0, 0, 0)
    mix = lambda d, m: (1 - frac) * d + frac * m  # noqa: E731
    fwd, core, gemm = mix(fwd_d, fwd_m), mix(core_d, core_m), mix(gemm_d, gemm_m)
    tokens = microbatch_size(job, layout) * job.seq_len / layout.cp
    act = job.act_bytes
    # the output head (and the loss) on the last stage, spread over its chunks
    head = 2.0 * tokens * s.vocab * s.dim / layout.tp / (job.peak_flops * hw.matmul_efficiency)
    # each kernel's fixed cost (Hardware.op_overhead): the forward's, the backward's twice
    kernels = blocks * mix(block_kernels(s, moe=False), block_kernels(s, moe=True))
    f_launch = (kernels + _HEAD_KERNELS / layout.chunks) * hw.op_overhead
    f_compute = blocks * fwd + head / layout.chunks + f_launch
    recompute = {"none": 0.0, "selective": blocks * (core + _CORE_KERNELS * hw.op_overhead),
                 "full": f_compute}[layout.remat]
    split_bw = layout.schedule in ("zb_h1", "zb_v")
    if split_bw:
        b_compute = f_compute + recompute
        w_compute = blocks * gemm + head / layout.chunks + f_launch
    else:
        b_compute = 2.0 * f_compute + recompute
        w_compute = 0.0
    f_comm: dict[str, float] = {}
    b_comm: dict[str, float] = {}
    if layout.tp > 1:
        link = axis_link(layout, ("tp",), hw, dpn)
        one = collective_time("all_reduce", tokens * s.dim * act, layout.tp, link, eff)
        f_comm["tp"] = blocks * 2 * one
        b_comm["tp"] = blocks * (4 if layout.remat == "full" else 2) * one
    if layout.cp > 1:
        link = axis_link(layout, ("cp",), hw, dpn)
        kv = 2.0 * tokens * s.kv_dim * act / layout.tp
        ring = (layout.cp - 1) * collective_time("send", kv, 2, link, eff)
        attn = core_d if not frac else mix(core_d, core_m)
        hide = attn if hw.overlap else 0.0
        f_comm["cp"] = blocks * max(0.0, ring - hide)
        b_comm["cp"] = blocks * max(0.0, 2 * ring - 2 * hide)
    if layout.ep > 1 and frac:
        link = hw.intra if layout.ep * layout.tp <= dpn else hw.inter
        a2a = collective_time("all_to_all", tokens * s.top_k * s.dim * act / layout.tp,
                              layout.ep, link, eff)
        f_comm["ep"] = blocks * frac * 2 * a2a
        b_comm["ep"] = blocks * frac * (4 if layout.remat == "full" else 2) * a2a
    if layout.pp > 1:
        link = axis_link(layout, ("pp",), hw, dpn)
        send = collective_time("send", tokens * s.dim * act / (layout.tp if layout.sp else 1),
                               2, link, eff)
        f_comm["pp"] = send
        b_comm["pp"] = send
    if layout.zero >= 2 and layout.zero_group > 1:
        link = axis_link(layout, ("dp_shard", "cp"), hw, dpn)
        n = layout.zero_group
        chunk_params = split.total / layout.chunks
        units = _sharded_collectives(job, blocks) - 1  # the latency of all but one on top
        rs = collective_time("reduce_scatter", chunk_params * DTYPE_BYTES[job.grad_dtype], n,
                             link, eff) + units * (n - 1) * link.latency
        gather = 0.0
        if layout.zero == 3:
            keep = DTYPE_BYTES[job.dtype]
            gather = collective_time("all_gather", chunk_params * keep, n, link, eff) + (
                units * (n - 1) * link.latency)
            f_comm["zero3"] = _prefetched(gather, f_compute, blocks, hw.overlap)
        b_comm[f"zero{layout.zero}"] = _prefetched(gather + rs, b_compute + w_compute,
                                                   blocks, hw.overlap)
    f = _Action(f_compute, f_comm)
    b = _Action(b_compute, b_comm)
    w = _Action(w_compute, {}) if split_bw else None
    return f, b, w


_GRID = 0.25  # the ratios B/F and W/F the replay is run at; between them it interpolates


@functools.lru_cache(maxsize=65536)
def _replay(schedule: str, pp: int, m: int, chunks: int, b: float, w: float
            ) -> tuple[float, float]:
    from jaxpg.pipeline.schedule.costs import ActionCosts, timed

    tt = timetable(schedule, pp, m, chunks)
    replay = timed(tt, ActionCosts(1.0, b, w if tt.split_backward else 0.0))
    return replay.makespan, replay.busy / pp


def _makespan(schedule: str, pp: int, m: int, chunks: int, b: float, w: float
              ) -> tuple[float, float]:
    """(makespan, work per rank) of the timetable with costs (1, b, w), in F units.

    The event-driven replay's makespan is the longest path through the actions, a convex
    piecewise-linear function of the costs: it is replayed at the grid points around
    ``(b, w)`` and interpolated (exact where one path is the longest on the cell).
    """
    split = schedule in ("zb_h1", "zb_v")
    b0 = max(_GRID, _GRID * (b // _GRID))
    w0 = max(_GRID, _GRID * (w // _GRID)) if split else 0.0
    tb = (b - b0) / _GRID
    tw = (w - w0) / _GRID if split else 0.0
    corners = [(b0, w0, (1 - tb) * (1 - tw)), (b0 + _GRID, w0, tb * (1 - tw))]
    if split:
        corners += [(b0, w0 + _GRID, (1 - tb) * tw), (b0 + _GRID, w0 + _GRID, tb * tw)]
    makespan = sum(weight * _replay(schedule, pp, m, chunks, round(cb, 4), round(cw, 4))[0]
                   for cb, cw, weight in corners if weight)
    work = m * chunks * (1.0 + b + (w if split else 0.0))
    return makespan, work


def _sharded_collectives(job: Job, blocks: float) -> float:
    """The collectives one FSDP/ZeRO pass (a gather or a reduce-scatter) over ``blocks``
    blocks and the root (embedding, final norm, head) issues: one per FSDP unit, as torch's
    ``fully_shard`` issues them and XLA's GPU and TPU combiners merge per-tensor ones, or,
    where the compiler leaves them apart (``Hardware.per_tensor_collectives``: XLA:CPU),
    one per parameter tensor."""
    if job.hardware.per_tensor_collectives:
        root = 2 if job.model.tied_embeddings else 3
        return blocks * job.model.block_tensors + root
    return blocks + 1


def _after_pipeline(job: Job, layout: Layout, b_last: float) -> dict[str, float]:
    """Exposed seconds of the data-parallel synchronisation at the step's end."""
    hw, dpn, eff = job.hardware, job.devices_per_node, job.hardware.collective_efficiency
    split = param_split(job, layout)
    grad_b, keep_b = DTYPE_BYTES[job.grad_dtype], DTYPE_BYTES[job.dtype]
    out: dict[str, float] = {}
    overlap = job.overlap_grad_reduce and hw.overlap
    hide = b_last if overlap else 0.0
    bucket = max(split.layers_per_stage, 1)

    def tail(t: float) -> float:
        return max(t / bucket, t - hide) if overlap else t

    n_all = layout.dp_replicate * layout.dp_shard * layout.cp
    if layout.zero == 0 and n_all > 1:
        link = axis_link(layout, ("dp_replicate", "dp_shard", "cp"), hw, dpn)
        out["dp"] = tail(collective_time("all_reduce", split.total * grad_b, n_all, link,
                                            eff))
        return out
    n = layout.zero_group
    link = axis_link(layout, ("dp_shard", "cp"), hw, dpn)
    sync = 0.0
    if layout.zero == 1 and n_all > 1:  # ZeRO-1 all-reduces the whole gradient, as torch's
        # ZeroRedundancyOptimizer under DDP and jaxpg's stage 1 do; each rank then updates
        # its shard (ZeRO-2 reduce-scatters instead: priced with the backward)
        alink = axis_link(layout, ("dp_replicate", "dp_shard", "cp"), hw, dpn)
        sync += collective_time("all_reduce", split.total * grad_b, n_all, alink, eff)
    elif layout.dp_replicate > 1:  # HSDP: the shards' replicas all-reduce
        rlink = axis_link(layout, ("dp_replicate",), hw, dpn)
        sync += collective_time("all_reduce", split.total / n * grad_b, layout.dp_replicate,
                                rlink, eff)
    if sync:
        out["dp"] = tail(sync)
    if layout.zero in (1, 2) and n > 1:  # the updated working copy back to every rank
        out["zero_gather"] = collective_time("all_gather", split.total * keep_b, n, link,
                                             eff) + (_sharded_collectives(job, bucket) - 1) * (
            n - 1) * link.latency
    return out


def step_time(job: Job, layout: Layout, *, bubble: bool = True) -> StepTime:
    """The predicted time of one optimizer step of ``job`` under ``layout``.

    ``bubble=False`` leaves the pipeline's bubble out (no replay): a lower bound.
    """
    f, b, w = _actions(job, layout)
    m, v = layout.microbatches, layout.chunks
    if layout.pp == 1 or not bubble:
        work = m * v * (f.total + b.total + (w.total if w else 0.0))
        makespan = work
    else:
        unit = f.total
        makespan, work = _makespan(layout.schedule, layout.pp, m, v, b.total / unit,
                                   w.total / unit if w else 0.0)
        makespan, work = makespan * unit, work * unit
    actions = m * v
    compute = actions * (f.compute + b.compute + (w.compute if w else 0.0))
    comm = {k: actions * (f.comm.get(k, 0.0) + b.comm.get(k, 0.0))
            for k in {**f.comm, **b.comm}}
    tail = _after_pipeline(job, layout, b.compute + (w.compute if w else 0.0))
    comm.update(tail)
    exposed_comm = sum(comm.values())
    bubble = max(0.0, makespan - work)
    split = param_split(job, layout)
    d = layout.zero_group if layout.zero else 1
    hw = job.hardware
    tensors = split.layers_per_stage * job.model.block_tensors + 3  # embedding, norm, head
    optimizer = split.total / d * (4 * (job.optimizer_states + 1) * 2 + 2) / (
        hw.hbm_bandwidth) + tensors * _OPTIMIZER_KERNELS * hw.op_overhead
    if m > 1:  # each later microbatch's gradients added into the accumulator
        g = layout.zero_group if layout.zero >= 2 else 1
        optimizer += (m - 1) * (3 * split.total / g * DTYPE_BYTES[job.grad_dtype]
                                / hw.hbm_bandwidth + tensors * hw.op_overhead)
    return StepTime(compute, exposed_comm, bubble, optimizer, comm)
