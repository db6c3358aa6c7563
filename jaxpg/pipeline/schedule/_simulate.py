"""Turn per-rank action orders into a timetable by simulating unit-time ticks.

Each schedule is described by the *order* in which every rank runs its
actions (its priority rule). :func:`simulate` then plays the ranks forward
one tick at a time: a rank runs the next action of its order as soon as that
action's inputs exist (they were produced in a strictly earlier tick), and
idles otherwise. This is how a real pipeline executor behaves, and it makes
the idle slots (the bubble) fall out of the schedule instead of being drawn
by hand.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxpg.pipeline.schedule.timetable import Action, Timetable, model_stage

__all__ = ["dependencies", "simulate"]

Key = tuple[str, int, int]  # (kind, microbatch, model stage)


def dependencies(kind: str, microbatch: int, stage: int, num_model_stages: int) -> list[Key]:
    """The actions that must finish before ``kind`` of ``microbatch`` on ``stage``.

    * ``F`` on stage ``s`` needs ``F`` on ``s - 1`` (its input activation).
    * ``B`` on stage ``s`` needs ``F`` on ``s`` (the saved activations) and
      ``B`` on ``s + 1`` (the output gradient).
    * ``W`` on stage ``s`` needs ``B`` on ``s``.
    """
    if kind == "F":
        return [("F", microbatch, stage - 1)] if stage > 0 else []
    if kind == "B":
        deps = [("F", microbatch, stage)]
        if stage < num_model_stages - 1:
            deps.append(("B", microbatch, stage + 1))
        return deps
    if kind == "W":
        return [("B", microbatch, stage)]
    raise ValueError(f"kind={kind!r} must be 'F', 'B' or 'W'.")


def simulate(
    name: str,
    orders: Sequence[Sequence[Action]],
    *,
    num_microbatches: int,
    num_chunks: int = 1,
    split_backward: bool = False,
    layout: str = "loop",
) -> Timetable:
    """Run every rank's action order in unit-time ticks and record the grid.

    Args:
      name: The schedule's name, stored on the timetable.
      orders: ``orders[rank]`` is the sequence of actions rank ``rank`` runs,
        in its order of priority.
      num_microbatches: ``m``.
      num_chunks: ``v``, model chunks per rank.
      split_backward: Whether the orders contain ``W`` actions.
      layout: How chunks map to model stages (``"loop"`` or ``"v"``).

    Returns:
      The :class:`Timetable` the simulation produced.

    Raises:
      RuntimeError: If the orders deadlock (no rank can make progress), which
        means the orders themselves are inconsistent.
    """
    p = len(orders)
    num_model_stages = num_chunks * p
    done_at: dict[Key, int] = {}
    cursor = [0] * p
    grid: list[tuple[Action | None, ...]] = []
    remaining = sum(len(order) for order in orders)
    tick = 0
    while remaining:
        row: list[Action | None] = [None] * p
        for rank, order in enumerate(orders):
            if cursor[rank] == len(order):
                continue
            action = order[cursor[rank]]
            stage = model_stage(layout, p, rank, action.chunk)
            deps = dependencies(action.kind, action.microbatch, stage, num_model_stages)
            if all(done_at.get(dep, tick) < tick for dep in deps):
                row[rank] = action
        if all(a is None for a in row):
            stuck = {r: orders[r][cursor[r]] for r in range(p) if cursor[r] < len(orders[r])}
            raise RuntimeError(
                f"Schedule {name!r} deadlocks at tick {tick}: the next actions {stuck} all "
                "wait for inputs that no rank will produce."
            )
        for rank, action in enumerate(row):
            if action is not None:
                stage = model_stage(layout, p, rank, action.chunk)
                done_at[(action.kind, action.microbatch, stage)] = tick
                cursor[rank] += 1
                remaining -= 1
        grid.append(tuple(row))
        tick += 1
    return Timetable(
        name=name,
        num_stages=p,
        num_microbatches=num_microbatches,
        num_chunks=num_chunks,
        split_backward=split_backward,
        grid=tuple(grid),
        layout=layout,
    )
