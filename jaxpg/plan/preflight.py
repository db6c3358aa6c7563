"""Preflight: every configuration error of a layout, each with its fix, before launch.

:func:`problems` lists them; :func:`check` raises one :class:`LayoutError` naming them all.
The checks:

* ``devices``: the degrees' product against the job's devices;
* ``tp``: tensor parallelism against heads, kv heads and the MLP's width;
* ``cp``: context parallelism against the sequence (the ring's load balancing cuts it in
  ``2 cp`` pieces);
* ``microbatches``: against the pipeline's stages (fewer microbatches than stages leaves
  stages idle, and some executors wait forever for them), and each schedule's own rule;
* ``pp``: the stages (times chunks) against the layers (uneven stages are allowed: the
  largest one is planned);
* ``batch``: the global batch against ``dp x microbatches``;
* ``ep``: expert parallelism against the experts and against ``dp_shard x cp``, whose ranks
  it borrows;
* ``memory``: the predicted memory against the device's budget.

Example:
    >>> from jaxpg.plan import Job, Layout, get_model
    >>> job = Job(model=get_model("llama3-8b"), devices=16, hardware="h100-80gb",
    ...           seq_len=8192, global_batch=32)
    >>> [p.name for p in problems(Layout(tp=16), job)]
    ['tp', 'memory']
"""

from __future__ import annotations

import math
from typing import NamedTuple

from jaxpg.plan.job import Job
from jaxpg.plan.layout import Layout, divisors

__all__ = ["LayoutError", "Problem", "check", "problems"]


class Problem(NamedTuple):
    """One configuration error: which check, what is wrong, and how to fix it."""

    name: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"[{self.name}] {self.message} Fix: {self.fix}"


class LayoutError(ValueError):
    """A layout that cannot run the job; ``problems`` holds every :class:`Problem`."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"The layout has {len(self.problems)} problem(s):\n{lines}")


def _choices(values: list[int], limit: int = 8) -> str:
    shown = values[:limit]
    return ", ".join(map(str, shown)) + (", ..." if len(values) > limit else "")


def _structure(layout: Layout, job: Job) -> list[Problem]:
    s, out = job.model, []
    others = layout.devices // layout.dp_shard
    if layout.devices != job.devices:
        fix = (f"set dp_shard={job.devices // others} (or dp_shard=-1 in ParallelDims)"
               if job.devices % others == 0 else
               f"choose degrees whose product is {job.devices}")
        out.append(Problem("devices", f"dp_replicate x dp_shard x cp x tp x pp = "
                           f"{layout.devices}, but the job has {job.devices} devices.", fix))
    if s.heads % layout.tp or s.kv_heads % layout.tp:
        ok = [d for d in divisors(math.gcd(s.heads, s.kv_heads))]
        out.append(Problem("tp", f"tp={layout.tp} must divide heads={s.heads} and "
                           f"kv_heads={s.kv_heads}: each tensor-parallel rank holds whole heads.",
                           f"choose tp in {_choices(ok)}."))
    elif s.ffn % layout.tp or (s.is_moe and s.expert_ffn % layout.tp):
        out.append(Problem("tp", f"tp={layout.tp} must divide the MLP's width (ffn={s.ffn}"
                           + (f", expert_ffn={s.expert_ffn}" if s.is_moe else "") + ").",
                           "choose a tp that divides it."))
    if layout.cp > 1 and job.seq_len % (2 * layout.cp):
        ok = [c for c in divisors(job.seq_len // 2) if c <= 64]
        out.append(Problem("cp", f"cp={layout.cp} needs seq_len={job.seq_len} divisible by "
                           f"2 x cp = {2 * layout.cp} (the ring's load balancing cuts the "
                           "sequence in 2 cp pieces).",
                           f"pad the sequence to a multiple of {2 * layout.cp} or choose cp in "
                           f"{_choices(ok)}."))
    m, p, v = layout.microbatches, layout.pp, layout.chunks
    if p > 1:
        if m < p:
            out.append(Problem("microbatches", f"microbatches={m} is fewer than pp={p} "
                               "stages: stages sit idle, and an executor that waits for the "
                               "missing microbatches hangs.",
                               f"use microbatches >= {p} (4 x pp = {4 * p} or more keeps the "
                               "bubble small)."))
        elif layout.schedule == "interleaved_1f1b" and m % p:
            out.append(Problem("microbatches", f"interleaved_1f1b needs microbatches={m} to "
                               f"be a multiple of pp={p}.",
                               f"use microbatches={(m // p) * p or p} or {(m // p + 1) * p}."))
        if layout.schedule == "interleaved_1f1b" and v < 2:
            out.append(Problem("pp", "interleaved_1f1b runs chunks >= 2 model chunks per rank; "
                               f"got chunks={v}.", "set chunks=2 (or use 1f1b)."))
        if layout.schedule == "zb_v" and v != 2:
            out.append(Problem("pp", f"zb_v runs exactly 2 chunks per rank; got chunks={v}.",
                               "set chunks=2."))
        if layout.schedule not in ("interleaved_1f1b", "zb_v") and v != 1:
            out.append(Problem("pp", f"schedule={layout.schedule} runs one chunk per rank; got "
                               f"chunks={v}.", "set chunks=1 or use interleaved_1f1b."))
    if p * v > s.layers:
        out.append(Problem("pp", f"pp x chunks = {p} x {v} = {p * v} exceeds layers={s.layers}: "
                           "some stages would hold no block.",
                           f"choose pp x chunks <= {s.layers}."))
    per = layout.dp * m
    if job.global_batch % per:
        local = job.global_batch / layout.dp
        ok = [d for d in divisors(job.global_batch // layout.dp)] if local.is_integer() else []
        fix = (f"use microbatches in {_choices(ok)}" if ok else
               f"make global_batch a multiple of dp = {layout.dp}")
        out.append(Problem("batch", f"global_batch={job.global_batch} does not divide into "
                           f"dp = dp_replicate x dp_shard = {layout.dp} replicas x "
                           f"microbatches={m}.", fix + "."))
    if layout.ep > 1:
        if not s.is_moe:
            out.append(Problem("ep", f"ep={layout.ep} on a dense model (experts=0).",
                               "set ep=1."))
        elif s.experts % layout.ep:
            out.append(Problem("ep", f"ep={layout.ep} must divide experts={s.experts}: each "
                               "expert-parallel rank holds whole experts.",
                               f"choose ep in {_choices(divisors(s.experts))}."))
        if (layout.dp_shard * layout.cp) % layout.ep:
            out.append(Problem("ep", f"ep={layout.ep} must divide dp_shard x cp = "
                               f"{layout.dp_shard * layout.cp}: expert parallelism borrows "
                               "its ranks from them.",
                               f"raise dp_shard to a multiple of {layout.ep} or lower ep."))
    return out


def _memory_problem(layout: Layout, job: Job, mem=None) -> Problem | None:
    from jaxpg.plan.memory import GIB, memory

    mem = mem if mem is not None else memory(job, layout)
    budget = job.hardware.usable_bytes
    if mem.total <= budget:
        return None
    hints = []
    if layout.remat != "full":
        hints.append("remat=full")
    if layout.zero < 3 and layout.dp_shard * layout.cp > 1:
        hints.append("zero=3")
    if layout.tp < job.devices_per_node:
        hints.append(f"tp={layout.tp * 2}")
    hints.append(f"pp={layout.pp * 2}")
    if layout.microbatches < job.global_batch // layout.dp:
        hints.append("more microbatches")
    return Problem("memory", f"predicted {mem.total / GIB:.1f} GiB per device exceeds the "
                   f"budget {budget / GIB:.1f} GiB ({job.hardware.name}: "
                   f"{job.hardware.hbm_bytes / GIB:.0f} GiB x {job.hardware.memory_fraction}).",
                   "try " + ", ".join(hints) + ".")


def problems(layout: Layout, job: Job, *, memory: bool = True) -> list[Problem]:
    """Every configuration error of ``layout`` for ``job`` (empty when it can run)."""
    found = _structure(layout, job)
    schedule_broken = any(p.name in ("microbatches", "pp") for p in found)
    if memory and not schedule_broken:
        mem = _memory_problem(layout, job)
        if mem is not None:
            found.append(mem)
    return found


def check(layout: Layout, job: Job, *, memory: bool = True) -> None:
    """Raises :class:`LayoutError` naming every problem of ``layout`` for ``job``."""
    found = problems(layout, job, memory=memory)
    if found:
        raise LayoutError(found)
