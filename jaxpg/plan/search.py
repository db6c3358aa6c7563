"""The candidates: every layout of a job's devices worth predicting, ranked by step time.

:func:`candidates` walks the degrees (tp within a node and dividing the heads; pp up to the
layers; cp dividing the sequence's ``2 cp`` pieces; the data-parallel rest as pure ZeRO/FSDP,
pure replication, or HSDP with the shards inside a node; ep dividing the experts and
``dp_shard x cp``), then the microbatch sizes the batch allows, the schedules (one rule each:
``m >= pp``, interleaving's ``m % pp == 0``), the recomputation policies and the ZeRO stages.
:func:`search` drops those with problems (memory first: it is cheap), predicts the rest and
sorts them by step time.

Example:
    >>> from jaxpg.plan import Job, get_model
    >>> job = Job(model=get_model("llama3-8b"), devices=64, hardware="h100-80gb",
    ...           seq_len=8192, global_batch=256)
    >>> best = search(job, top=3)
    >>> len(best), best[0].fits
    (3, True)
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from jaxpg.plan.estimate import Estimate, evaluate
from jaxpg.plan.job import Job
from jaxpg.plan.layout import REMAT_POLICIES, Layout, divisors
from jaxpg.plan.memory import memory
from jaxpg.plan.preflight import problems
from jaxpg.plan.step_time import step_time

__all__ = ["DEFAULT_SCHEDULES", "candidates", "search"]

DEFAULT_SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1")


def _dp_splits(d: int, room: int) -> list[tuple[int, int]]:
    """(dp_replicate, dp_shard) pairs for ``d`` replicas: all ZeRO, all DDP, and HSDP with the
    shards filling what is left of a node (``room`` devices)."""
    splits = {(1, d), (d, 1)}
    inside = max((s for s in divisors(d) if s <= room), default=1)
    if 1 < inside < d:
        splits.add((d // inside, inside))
    return sorted(splits)


def candidates(job: Job, *, schedules: Sequence[str] = DEFAULT_SCHEDULES,
               remats: Sequence[str] = REMAT_POLICIES, zeros: Sequence[int] = (1, 2, 3),
               microbatch_sizes: Sequence[int] = (1, 2, 4, 8), max_cp: int = 16,
               ) -> Iterator[Layout]:
    """Every layout of ``job.devices`` that passes the structural preflight checks."""
    s, n, dpn = job.model, job.devices, job.devices_per_node
    for tp in divisors(n):
        if (tp > dpn or s.heads % tp or s.kv_heads % tp or s.ffn % tp
                or (s.is_moe and s.expert_ffn % tp)):
            continue
        for pp in divisors(n // tp):
            if pp > s.layers:
                continue
            for cp in divisors(n // (tp * pp)):
                if cp > max_cp or (cp > 1 and job.seq_len % (2 * cp)):
                    continue
                d = n // (tp * pp * cp)
                if job.global_batch % d:
                    continue
                local = job.global_batch // d
                room = max(1, dpn // (tp * cp))
                for rep, shard in _dp_splits(d, room):
                    eps = [1]
                    if s.is_moe:
                        eps = divisors(math.gcd(s.experts, shard * cp))
                    for ep in eps:
                        yield from _inner(job, local, dict(
                            dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp, pp=pp, ep=ep),
                            schedules, remats, zeros, microbatch_sizes)


def _inner(job, local, degrees, schedules, remats, zeros, microbatch_sizes):
    pp, layers = degrees["pp"], job.model.layers
    zero_group = degrees["dp_shard"] * degrees["cp"]
    for b in microbatch_sizes:
        if local % b:
            continue
        m = local // b
        if pp == 1:
            plans = [("none", 1)]
        else:
            plans = [(name, {"interleaved_1f1b": 2, "zb_v": 2}.get(name, 1))
                     for name in schedules if m >= pp]
            plans = [(name, v) for name, v in plans
                     if not (name == "interleaved_1f1b" and (m % pp or 2 * pp > layers))]
        for schedule, v in plans:
            for remat in remats:
                for zero in (zeros if zero_group > 1 else (0,)):
                    yield Layout(**degrees, microbatches=m, schedule=schedule, chunks=v,
                                 remat=remat, zero=zero)


def search(job: Job, *, top: int | None = None, **options) -> list[Estimate]:
    """The layouts that fit ``job``, fastest first (``options`` go to :func:`candidates`).

    Memory and the structural checks filter first (no replay); with ``top`` the survivors
    are predicted in the order of their bubble-free lower bound, stopping once that bound
    passes the ``top``-th best prediction (the result is the same as predicting all).

    Args:
        job: the job.
        top: keep only the ``top`` fastest (None: all).
    """
    budget = job.hardware.usable_bytes
    pool = []
    for layout in candidates(job, **options):
        if memory(job, layout).total > budget or problems(layout, job, memory=False):
            continue
        pool.append((step_time(job, layout, bubble=False).total, layout))
    pool.sort(key=lambda item: item[0])
    found: list[Estimate] = []
    for bound, layout in pool:
        if top and len(found) >= top and bound > found[top - 1].step_s:
            break
        found.append(evaluate(layout, job))
        if top and len(found) >= top:
            found = sorted(found, key=_rank)[:top]
    return sorted(found, key=_rank)[:top] if top else sorted(found, key=_rank)


def _rank(est: Estimate) -> tuple:
    """Fastest first; among equals (to 0.1%), the simpler layout and then less memory."""
    lay = est.layout
    return (round(est.step_s, 3 - int(math.floor(math.log10(est.step_s)))),
            lay.pp * lay.cp * lay.tp * lay.ep, est.memory.total)
