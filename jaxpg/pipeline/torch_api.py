"""torch's faces: ``PipelineStage`` (:mod:`jaxpg.pipeline.stage.pipeline_stage`) and the
schedule classes over it.

``ScheduleGPipe``, ``Schedule1F1B`` (one stage per process) and
``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``, ``ScheduleLoopedBFS``,
``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV`` (several stages per process) take torch's
``(stage or stages, n_microbatches, loss_fn)`` and run jaxpg's timetables
(``jaxpg.pipeline.schedule.builders``) on the process executor for stages that differ
(``jaxpg.pipeline.process.stage_runner``). As in torch, every process calls ``step`` at once:
``step(x)`` on the process of the first stage (``x`` is split into ``n_microbatches``
along dimension 0), ``step(target=y, losses=losses)`` on the last one (``losses`` is
filled with each microbatch's ``loss_fn(output, target)``), ``step()`` in between. The
last stage's ``step`` returns its outputs, the microbatches' concatenated. After a step
each stage's ``grads`` hold its parameters' gradients, accumulated as torch accumulates
``.grad`` (see ``jaxpg.pipeline.stage.pipeline_stage``), and averaged over the stage's
``data_parallel_group`` when it has one. A tensor-parallel stage
(``tensor_parallel_group=``) runs as SPMD programs over its tp group; each of its
processes calls ``step`` as if it held the stage alone, with the same inputs or targets.

Placement, as torch's: with one stage per process the stage's index is its pipeline rank;
``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble`` and ``ScheduleLoopedBFS`` put
stage ``s`` on rank ``s % p`` (a loop), ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``
put stages ``r`` and ``2 p - 1 - r`` on rank ``r`` (a V).

Made, a schedule checks what it can before any step: its microbatch count by torch's rule
for the class (``Schedule1F1B`` takes at least its stages), and one pipeline rank per
process (``jaxpg.pipeline.process.stage_processes``); the first step checks, on every rank, that
each stage takes the previous stage's output (``jaxpg.pipeline.process.stage_runner``).

``ScheduleInterleavedZeroBubble`` runs the interleaved 1F1B order with the backward split
into ``B`` and ``W``, each ``W`` right after its ``B``: the same gradients as torch's, not
its bubble-filling order. ``ScheduleDualPipeV`` runs torch's order; each of its
overlapped pairs (one stage's forward, the other stage's backward) runs as the forward then
the backward, as torch's runtime runs the pair's parts.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from jaxpg.collectives.reductions import all_reduce
from jaxpg.pipeline.process.stage_processes import refuse_local_ranks
from jaxpg.pipeline.process.stage_runner import exchange_shapes, rank_setup, run_step
from jaxpg.pipeline.schedule.builders import (
    dualpipe_v,
    gpipe,
    interleaved_1f1b,
    interleaved_zero_bubble,
    looped_bfs,
    one_f_one_b,
    zero_bubble_v,
)
from jaxpg.pipeline.schedule.timetable import Timetable
from jaxpg.pipeline.stage.pipeline_stage import PipelineStage
from jaxpg.reduce_op import ReduceOp
from jaxpg.supervision.collective_call import recorded_region

__all__ = [
    "PipelineStage", "PipelineScheduleSingle", "PipelineScheduleMulti", "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV", "ScheduleLoopedBFS",
]  # fmt: skip


@functools.partial(jax.jit, static_argnums=1)
def _split_rows(leaves: tuple, m: int) -> tuple:
    """Each leaf cut into ``m`` equal parts along dimension 0 (one program)."""
    return tuple(tuple(jnp.split(a, m)) for a in leaves)


def _data_parallel_mean(grads: Any, group: Any) -> Any:
    """``grads`` averaged over the data-parallel ``group`` (one all_reduce of them all)."""
    flat, unravel = ravel_pytree(grads)
    return unravel(all_reduce(flat, op=ReduceOp.AVG, group=group))


@jax.jit
def _accumulate(prev: Any, step: Any, factor: Any) -> Any:
    if prev is None:
        return jax.tree.map(lambda g: g / jnp.asarray(factor, g.dtype), step)
    return jax.tree.map(lambda a, g: (a + g) / jnp.asarray(factor, g.dtype), prev, step)


class _PipelineSchedule:
    _name = "?"

    def __init__(self, stages: list[PipelineStage], n_microbatches: int,
                 loss_fn: Callable | None, scale_grads: bool) -> None:
        api = type(self).__name__
        if (isinstance(n_microbatches, bool) or not isinstance(n_microbatches, numbers.Integral)
                or n_microbatches < 1):
            raise ValueError(f"{api} n_microbatches={n_microbatches!r} must be an int >= 1.")
        for st in stages:
            if not isinstance(st, PipelineStage):
                raise TypeError(f"{api} takes PipelineStage objects, got {type(st).__name__}.")
        group = stages[0].group
        if any(st.group is not group for st in stages):
            raise ValueError(f"{api}: the stages belong to different process groups.")
        p, v = group.size(), len(stages)
        for st in stages:
            if st.num_stages != p * v:
                raise ValueError(f"{api} with {v} stage(s) per process over a pipeline group of "
                                 f"{p} needs num_stages={p * v}; stage {st.stage_index} has "
                                 f"num_stages={st.num_stages}.")
        if p < 2:
            raise ValueError(f"{api} needs a pipeline group of at least 2 processes (one per "
                             f"pipeline rank), got {p}.")
        try:
            self._tt = self._timetable(p, int(n_microbatches), v)
        except ValueError as err:
            raise ValueError(f"{api} n_microbatches={n_microbatches} over {p * v} stages: "
                             f"{err}") from err
        r = stages[0].group_rank
        want = sorted(self._tt.stage_of(r, c) for c in range(v))
        got = sorted(st.stage_index for st in stages)
        if got != want:
            raise ValueError(f"{api} runs stages {want} on pipeline rank {r} (its placement), "
                             f"but this process passed stages {got}.")
        self._check_microbatches(int(n_microbatches), p * v)
        refuse_local_ranks(stages, api)
        self._stages = {st.stage_index: st for st in stages}
        self._n_microbatches = int(n_microbatches)
        self._loss_fn = loss_fn
        self.scale_grads = bool(scale_grads)
        self._setup = rank_setup(self._tt, group)
        self._shapes: tuple[dict, dict] | None = None
        self._first_structs: Any = None
        self._what = f"{api} (pipeline rank {r})"

    def _timetable(self, p: int, m: int, v: int) -> Timetable:
        raise NotImplementedError

    def _check_microbatches(self, m: int, num_stages: int) -> None:
        """The class's rule on ``n_microbatches`` beyond ``>= 1`` (torch's, per class)."""

    @property
    def timetable(self) -> Timetable:
        """The jaxpg timetable this schedule runs."""
        return self._tt

    def _split(self, tree: Any, name: str, device: Any) -> list:
        m = self._n_microbatches
        leaves, treedef = jax.tree.flatten(tree)
        for a in leaves:
            if not hasattr(a, "shape") or len(a.shape) == 0 or a.shape[0] % m:
                shape = getattr(a, "shape", None)
                raise ValueError(f"{self._what}: {name} of shape {shape} does not split into "
                                 f"n_microbatches={m} equal microbatches along dimension 0; "
                                 f"use a batch size that is a multiple of {m}.")
        parts = _split_rows(tuple(jax.device_put(a, device) for a in leaves), m)
        return [jax.tree.unflatten(treedef, [p[i] for p in parts]) for i in range(m)]

    def step(self, *args: Any, target: Any = None, losses: list | None = None,
             return_outputs: bool = True) -> Any:
        """One training step over the whole batch (see the module docstring).

        Args:
            *args: the model's inputs, on the process of the first stage (ignored on the
                others, as torch does).
            target: the loss's target, on the process of the last stage.
            losses: a list, filled with each microbatch's loss on the last stage.
            return_outputs: whether the last stage returns its outputs.

        Returns:
            The last stage's outputs (microbatches concatenated), else ``None``.
        """
        if self._loss_fn is None:
            raise ValueError(f"{self._what}: step() needs the schedule's loss_fn.")
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"{self._what}: losses must be a list, got {type(losses).__name__}.")
        first, last = 0 in self._stages, self._tt.num_model_stages - 1 in self._stages
        mb_args = targets = None
        if first:
            if not args:
                raise ValueError(f"{self._what}: this process holds the first stage; call "
                                 "step(x) with the model's inputs.")
            mb_args = self._split(tuple(args), "the inputs", self._stages[0].device)
        if last:
            if target is None:
                raise ValueError(f"{self._what}: this process holds the last stage; call "
                                 "step(target=y, losses=losses) with the loss's target.")
            targets = self._split(target, "target", self._stages[max(self._stages)].device)
        if self._shapes is None:
            self._shapes = exchange_shapes(self._tt, self._setup, self._stages,
                                           mb_args[0] if first else None, self._what,
                                           self._stages[min(self._stages)].group,
                                           self._loss_fn, targets[0] if last else None)
        elif first:
            structs = [(a.shape, a.dtype) for a in mb_args[0]]
            if structs != [(a.shape, a.dtype) for a in self._shapes[0][0]]:
                raise ValueError(f"{self._what}: the microbatches' shapes changed from "
                                 f"{self._shapes[0][0]} to {structs}; a schedule keeps the "
                                 "shapes of its first step (as torch's): make a new schedule.")
        group = self._stages[min(self._stages)].group
        timeout = group.timeout.total_seconds()
        fingerprint = (f"{type(self).__name__}.step", (self._n_microbatches,), ())
        with recorded_region(group, f"{type(self).__name__}.step", fingerprint, "pipeline"):
            grads, mb_losses, outs = run_step(self._tt, self._setup, self._stages,
                                              self._shapes, self._loss_fn, mb_args, targets,
                                              timeout, self._what)
        factor = self._n_microbatches if self.scale_grads else 1
        for s, st in sorted(self._stages.items()):  # the same order on every replica
            summed = st.finish_grads(grads[s])
            step_grads = summed if st.dp_group is None else \
                _data_parallel_mean(summed, st.dp_group) if st.tp is None else \
                st.tp.data_parallel_mean(summed, st.dp_group)
            st.grads = _accumulate(st.grads, step_grads, factor)
        if last and losses is not None:
            losses.clear()
            losses.extend(mb_losses[i] for i in range(self._n_microbatches))
        if last and return_outputs:
            merged = [jnp.concatenate(parts) for parts in zip(
                *(outs[i] for i in range(self._n_microbatches)), strict=True)]
            return merged[0] if len(merged) == 1 else tuple(merged)
        return None


class PipelineScheduleSingle(_PipelineSchedule):
    """A schedule of one stage per process: ``(stage, n_microbatches, loss_fn)``."""

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Callable | None = None,
                 *, scale_grads: bool = True) -> None:
        if isinstance(stage, list | tuple):
            raise TypeError(f"{type(self).__name__} takes one PipelineStage, got a "
                            f"{type(stage).__name__}; for several stages per process use "
                            "ScheduleInterleaved1F1B or ScheduleZBVZeroBubble.")
        super().__init__([stage], n_microbatches, loss_fn, scale_grads)


class PipelineScheduleMulti(_PipelineSchedule):
    """A schedule of several stages per process: ``(stages, n_microbatches, loss_fn)``."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int,
                 loss_fn: Callable | None = None, *, scale_grads: bool = True) -> None:
        if not isinstance(stages, list | tuple) or not stages:
            raise TypeError(f"{type(self).__name__} takes a non-empty list of PipelineStage, "
                            f"got {stages!r}.")
        super().__init__(list(stages), n_microbatches, loss_fn, scale_grads)


class ScheduleGPipe(PipelineScheduleSingle):
    """GPipe: every microbatch's forward, then every backward (``jaxpg``'s ``gpipe``)."""

    def _timetable(self, p: int, m: int, v: int) -> Timetable:
        return gpipe(p, m)


class Schedule1F1B(PipelineScheduleSingle):
    """1F1B: warmup forwards, then one forward and one backward in turn (``1f1b``).

    As torch's, it takes at least as many microbatches as stages: with fewer, the
    pipeline never fills and most of the step is bubble.
    """

    def _timetable(self, p: int, m: int, v: int) -> Timetable:
        return one_f_one_b(p, m)

    def _check_microbatches(self, m: int, num_stages: int) -> None:
        if m < num_stages:
            raise ValueError(
                f"Schedule1F1B n_microbatches={m} must be >= the number of stages "
                f"({num_stages}), as torch's Schedule1F1B requires: with fewer microbatches "
                f"than stages the step is mostly bubble. Use n_microbatches >= {num_stages} "
                f"(a batch that splits into them), or ScheduleGPipe for {m}.")


class ScheduleInterleaved1F1B(PipelineScheduleMulti):
    """Megatron's interleaved 1F1B over stages placed in a loop (``interleaved_1f1b``)."""

    def _timetable(self, p: int, m: int, v: int) -> Timetable:
        return interleaved_1f1b(p, m, v)


class ScheduleInterleavedZeroBubble(PipelineScheduleMulti):
    """Interleaved 1F1B with the backward split into ``B`` and ``W`` (loop placement)."""

    def _timetable(self, p: int, m: int, v: int) -> Timetable:
        return interleaved_zero_bubble(p, m, v)


class ScheduleZBVZeroBubble(PipelineScheduleMulti):
    """ZB-V: two stages per process in a V, the backward split (``zb_v``)."""

    def _timetable(self, p: int, m: int, v: int) -> Timetable:
        if v != 2:
            raise ValueError(f"ScheduleZBVZeroBubble takes exactly 2 stages per process (a V), "
                             f"got {v}.")
        return zero_bubble_v(p, m)


class ScheduleLoopedBFS(PipelineScheduleMulti):
    """Looped breadth-first: every microbatch through one stage before the next stage
    (``looped_bfs``, loop placement, any number of stages per process)."""

    def _timetable(self, p: int, m: int, v: int) -> Timetable:
        return looped_bfs(p, m, v)


class ScheduleDualPipeV(PipelineScheduleMulti):
    """DualPipeV: two stages per process in a V, forward-backward pairs in the steady state
    (``dualpipe_v``). As torch's, it takes at least as many microbatches as stages."""

    def _timetable(self, p: int, m: int, v: int) -> Timetable:
        if v != 2:
            raise ValueError(f"ScheduleDualPipeV takes exactly 2 stages per process (a V), "
                             f"got {v}.")
        if m < 2 * p:
            raise ValueError(f"ScheduleDualPipeV needs n_microbatches >= the number of stages "
                             f"({2 * p}), as torch's does; use n_microbatches >= {2 * p} (a "
                             f"batch that splits into them).")
        return dualpipe_v(p, m)
