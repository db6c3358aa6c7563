"""Timetables weighted by what their actions cost: bubbles in time, and the tick's price.

A :class:`Timetable` counts every action as one tick. Real actions differ: a whole
backward costs about twice a forward, and a zero-bubble split gives ``B`` and ``W``
about one forward each. :class:`ActionCosts` holds the three weights, and:

* :func:`timed` replays a timetable *event-driven*: each rank runs its actions in the
  timetable's order, each as soon as the rank is free and its inputs are finished. This
  is what an asynchronous executor (torch's, one process per rank) achieves; its
  makespan and bubble are in cost units.
* :func:`lockstep_time` is what jaxpg's SPMD executor pays: all ranks step through the
  ticks together (one ``lax.scan`` step with ``ppermute`` at its end), so a tick lasts
  as long as its slowest action. Next to a ``B`` of cost 2, an ``F`` of cost 1 waits 1.
* :func:`jaxpg.pipeline.stage.measured_costs.measure_costs` times one stage's ``F``, ``B``
  and ``W`` pieces on this machine (it runs jax; this module is plain Python).
* :func:`ideal_step_time` is the bound a pipeline's measured step is judged against.

Example:
    >>> from jaxpg.pipeline.schedule.builders import get_schedule
    >>> tt = get_schedule("1f1b", 4, 8)
    >>> costs = default_costs(tt)
    >>> costs
    ActionCosts(F=1.0, B=2.0, W=0.0)
    >>> timed(tt, costs).makespan, lockstep_time(tt, costs)
    (33.0, 40.0)
"""

from __future__ import annotations

from typing import NamedTuple

from jaxpg.pipeline.schedule._simulate import dependencies
from jaxpg.pipeline.schedule.timetable import Action, Timetable

__all__ = [
    "ActionCosts", "TimedTimetable", "default_costs", "ideal_step_time", "lockstep_time",
    "timed",
]  # fmt: skip


class ActionCosts(NamedTuple):
    """The cost of one ``F``, ``B`` and ``W`` (any unit; ``F = 1`` by convention).

    Without a split backward ``B`` is the whole backward and ``W`` is unused.
    """

    F: float = 1.0
    B: float = 2.0
    W: float = 0.0

    def of(self, kind: str) -> float:
        """The cost of an action of kind ``kind``."""
        return float(getattr(self, kind))


def default_costs(tt: Timetable) -> ActionCosts:
    """1:1:1 for a split backward (``T_F = T_B = T_W``), else 1:2 for F:B."""
    return ActionCosts(1.0, 1.0, 1.0) if tt.split_backward else ActionCosts(1.0, 2.0, 0.0)


def _check(costs: ActionCosts, tt: Timetable) -> ActionCosts:
    if not isinstance(costs, ActionCosts):
        costs = ActionCosts(*costs)
    kinds = ("F", "B", "W") if tt.split_backward else ("F", "B")
    for kind in kinds:
        value = costs.of(kind)
        if not value > 0:
            raise ValueError(f"ActionCosts {kind}={value!r} must be positive for {tt.name!r}.")
    return costs


class TimedTimetable(NamedTuple):
    """A timetable replayed with action costs (see :func:`timed`).

    Attributes:
      timetable: The timetable.
      costs: The costs used.
      start: ``start[(rank, tick)]``, when the action in that cell starts.
      makespan: When the last action finishes.
    """

    timetable: Timetable
    costs: ActionCosts
    start: dict[tuple[int, int], float]
    makespan: float

    @property
    def busy(self) -> float:
        """Total work, summed over ranks."""
        tt = self.timetable
        return sum(self.costs.of(a.kind) for row in tt.grid for a in row if a is not None)

    @property
    def bubble_fraction(self) -> float:
        """Idle time over ``p * makespan``, in cost units."""
        total = self.timetable.num_stages * self.makespan
        return (total - self.busy) / total if total else 0.0


def timed(tt: Timetable, costs: ActionCosts | None = None) -> TimedTimetable:
    """Replays ``tt`` event-driven with ``costs`` (default :func:`default_costs`).

    Each rank keeps the timetable's order of its actions; an action starts when the
    rank has finished its previous action and every input is finished (the same
    dependencies the checker uses). Messages take no time.
    """
    costs = _check(costs or default_costs(tt), tt)
    p, n = tt.num_stages, tt.num_model_stages
    finish: dict[tuple[str, int, int], float] = {}
    start: dict[tuple[int, int], float] = {}
    free = [0.0] * p
    for tick, row in enumerate(tt.grid):  # tick order is a valid topological order
        for rank, action in enumerate(row):
            if action is None:
                continue
            stage = tt.stage_of(rank, action.chunk)
            deps = dependencies(action.kind, action.microbatch, stage, n)
            begin = max([free[rank]] + [finish[d] for d in deps])
            start[(rank, tick)] = begin
            free[rank] = begin + costs.of(action.kind)
            finish[(action.kind, action.microbatch, stage)] = free[rank]
    return TimedTimetable(tt, costs, start, max(free, default=0.0))


def ideal_step_time(t1: float, p: int, m: int) -> float:
    """The shortest step ``p`` stages can take over ``m`` equal microbatches, from ``t1``,
    the un-pipelined step on one device: ``t1 (m + p - 1) / (m p)``.

    Each stage does ``1 / p`` of the work of each microbatch, ``t1 / (m p)``, and the
    first microbatch's output reaches the last stage after ``p - 1`` such slots: GPipe's and
    1F1B's bubble. A pipeline's efficiency is this bound over its measured step.

    Example:
        >>> ideal_step_time(1.0, p=2, m=8)
        0.5625
    """
    for name, value in (("p", p), ("m", m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"ideal_step_time: {name}={value!r} must be an int >= 1.")
    return t1 * (m + p - 1) / (m * p)


def lockstep_time(tt: Timetable, costs: ActionCosts | None = None) -> float:
    """The time of ``tt`` when every tick lasts as long as its slowest action.

    This is jaxpg's executor on truly parallel devices: one ``lax.scan`` step per tick
    for all ranks, and a ``ppermute`` at the end of each that waits for everyone.
    """
    costs = _check(costs or default_costs(tt), tt)
    return sum(max((costs.of(a.kind) for a in row if a is not None), default=0.0)
               for row in tt.grid)  # fmt: skip


def cell_cost(action: Action | None, costs: ActionCosts) -> float:
    """The cost of one timetable cell (0 for idle)."""
    return 0.0 if action is None else costs.of(action.kind)
