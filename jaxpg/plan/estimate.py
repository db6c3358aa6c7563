"""One layout evaluated: its memory, its step time, throughput, MFU and problems.

Example:
    >>> from jaxpg.plan import Job, Layout, get_model
    >>> job = Job(model=get_model("gpt-1.7b"), devices=32, hardware="a100-80gb",
    ...           seq_len=2048, global_batch=512)
    >>> est = evaluate(Layout.parse("dp_replicate=32,microbatches=16,remat=full"), job)
    >>> est.fits, list(est.to_json())[:3]
    (True, ['dp_replicate', 'dp_shard', 'cp'])
"""

from __future__ import annotations

import dataclasses

from jaxpg.plan.job import Job
from jaxpg.plan.layout import Layout
from jaxpg.plan.memory import GIB, Memory, memory
from jaxpg.plan.preflight import Problem, problems
from jaxpg.plan.step_time import StepTime, step_time

__all__ = ["JSON_KEYS", "Estimate", "evaluate"]

JSON_KEYS = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "microbatches", "schedule",
             "remat", "memory_gib", "step_s", "tokens_per_s_per_device", "mfu")


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A layout with its predictions.

    Attributes:
        layout: the layout.
        job: the job.
        memory: per-device bytes by kind (None when the layout cannot be built).
        time: the step's seconds by kind (None when the layout cannot be built).
        problems: every configuration error (empty: it runs and fits).
    """

    layout: Layout
    job: Job
    memory: Memory | None
    time: StepTime | None
    problems: tuple[Problem, ...]

    @property
    def fits(self) -> bool:
        """Whether the layout runs the job within the memory budget."""
        return not self.problems

    @property
    def step_s(self) -> float:
        return self.time.total if self.time else float("inf")

    @property
    def tokens_per_s_per_device(self) -> float:
        if not self.time:
            return 0.0
        return self.job.tokens_per_step / self.step_s / self.job.devices

    @property
    def mfu(self) -> float:
        """Model FLOPs (3x forward, no recomputation) over peak, per device."""
        if not self.time:
            return 0.0
        flops = self.job.model.train_flops_per_token(self.job.seq_len)
        return self.tokens_per_s_per_device * flops / self.job.peak_flops

    def parallel_dims(self, **kwargs):
        """The layout's :class:`jaxpg.ParallelDims` (see :meth:`Layout.parallel_dims`)."""
        return self.layout.parallel_dims(**kwargs)

    def to_json(self) -> dict:
        """The JSON record: ``JSON_KEYS``, then the breakdowns."""
        lay = self.layout
        out = {**lay.degrees(), "microbatches": lay.microbatches, "schedule": lay.schedule,
               "remat": lay.remat,
               "memory_gib": round(self.memory.total_gib, 3) if self.memory else None,
               "step_s": self.step_s if self.time else None,
               "tokens_per_s_per_device": self.tokens_per_s_per_device,
               "mfu": self.mfu,
               "chunks": lay.chunks, "zero": lay.zero, "sp": lay.sp,
               "fits": self.fits,
               "memory_breakdown_gib": self.memory.as_gib() if self.memory else None,
               "time_breakdown_s": None if not self.time else {
                   "compute": self.time.compute, "exposed_comm": self.time.exposed_comm,
                   "bubble": self.time.bubble, "optimizer": self.time.optimizer,
                   "comm": dict(self.time.comm)},
               "problems": [p._asdict() for p in self.problems],
               "parallel_dims": lay.parallel_dims_kwargs()}
        return out

    def summary(self) -> str:
        """A few lines for people."""
        lines = [f"layout  {self.layout}"]
        if self.memory:
            g = self.memory.as_gib()
            lines.append(
                f"memory  {g['total']:.2f} GiB per device: params {g['params']:.2f}, grads "
                f"{g['grads']:.2f}, optimizer {g['optimizer']:.2f}, activations "
                f"{g['activations']:.2f}, temporaries {g['temporaries']:.2f} "
                f"(budget {self.job.hardware.usable_bytes / GIB:.1f})")
        if self.time:
            t = self.time
            comm = ", ".join(f"{k} {v:.3g}" for k, v in sorted(t.comm.items()) if v > 0)
            lines.append(
                f"time    {t.total:.4g} s per step: compute {t.compute:.4g}, exposed comm "
                f"{t.exposed_comm:.3g}" + (f" ({comm})" if comm else "") +
                f", bubble {t.bubble:.3g}, optimizer {t.optimizer:.3g}")
            lines.append(f"speed   {self.tokens_per_s_per_device:,.0f} tokens/s per device, "
                         f"MFU {self.mfu:.1%}")
        lines.append("fits" if self.fits else "DOES NOT RUN:\n" + "\n".join(
            f"  - {p}" for p in self.problems))
        return "\n".join(lines)


def evaluate(layout: Layout, job: Job) -> Estimate:
    """Predicts ``layout`` for ``job``, even one that does not fit (its problems say why)."""
    found = problems(layout, job, memory=False)
    buildable = not any(p.name in ("microbatches", "pp") for p in found)
    mem = tim = None
    if buildable:
        mem = memory(job, layout)
        tim = step_time(job, layout)
        from jaxpg.plan.preflight import _memory_problem

        extra = _memory_problem(layout, job, mem)
        if extra is not None:
            found.append(extra)
    return Estimate(layout, job, mem, tim, tuple(found))
