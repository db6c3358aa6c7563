"""Check that a timetable is a correct pipeline schedule, and measure its memory.

:func:`check_timetable` proves, on the data alone, that an executor which
follows the timetable computes the same gradients as a sequential forward and
backward: every action runs exactly once, every action's inputs were made in
a strictly earlier tick, and no rank keeps more activations alive than the
schedule promises. :func:`peak_in_flight` gives those activation counts, which
the executor uses to size its buffers. :func:`check_bubble` compares a schedule's idle
time, replayed with action costs, with its paper's bubble formula.

An activation is *in flight* on a rank from the tick of its F until the tick
of the action that releases it: the B when the backward is whole, the W when
the backward is split (the weight gradient still reads the stage input).
Counts are per rank, summed over the rank's chunks, one per (microbatch,
chunk).

Example:
    >>> from jaxpg.pipeline.schedule.builders import one_f_one_b
    >>> tt = one_f_one_b(4, 8)
    >>> check_timetable(tt)
    >>> peak_in_flight(tt)
    [4, 3, 2, 1]
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxpg.pipeline.schedule._simulate import dependencies
from jaxpg.pipeline.schedule.builders import interleaved_warmup
from jaxpg.pipeline.schedule.costs import ActionCosts, default_costs, timed
from jaxpg.pipeline.schedule.timetable import Timetable

__all__ = [
    "check_bubble", "check_timetable", "default_in_flight_limits", "paper_bubble",
    "peak_in_flight",
]  # fmt: skip


def _describe(tt: Timetable, kind: str, microbatch: int, stage: int) -> str:
    rank, chunk = stage % tt.num_stages, stage // tt.num_stages
    where = f"rank {rank}, chunk {chunk}" if tt.num_chunks > 1 else f"rank {rank}"
    return f"{kind} of microbatch {microbatch} on stage {stage} ({where})"


def peak_in_flight(tt: Timetable, until: str | None = None) -> list[int]:
    """The most activations each rank holds at once.

    Args:
      tt: The timetable.
      until: The kind of action that releases an activation: ``"B"`` or
        ``"W"``. Defaults to ``"W"`` when ``tt.split_backward``, else ``"B"``.

    Returns:
      ``peaks[rank]``, the largest number of (microbatch, chunk) pairs whose F
      has run on that rank and whose releasing action has not, counted just
      after each tick.
    """
    if until is None:
        until = "W" if tt.split_backward else "B"
    if until not in ("B", "W") or (until == "W" and not tt.split_backward):
        allowed = "'B' or 'W'" if tt.split_backward else "'B' (the backward is not split)"
        raise ValueError(f"peak_in_flight until={until!r} must be {allowed}.")
    return [
        max((live for _, live in _live_counts(tt, rank, until)), default=0)
        for rank in range(tt.num_stages)
    ]


def _live_counts(tt: Timetable, rank: int, until: str) -> list[tuple[int, int]]:
    """``(tick, activations held just after that tick)`` for each busy tick of ``rank``."""
    live, counts = 0, []
    for tick, action in tt.actions_of(rank):
        live += (action.kind == "F") - (action.kind == until)
        counts.append((tick, live))
    return counts


def default_in_flight_limits(tt: Timetable) -> list[int] | None:
    """The per-rank in-flight bound each known schedule promises, else ``None``.

    * ``gpipe``: ``m`` on every rank.
    * ``1f1b``: ``min(p - s, m)`` on rank ``s``.
    * ``interleaved_1f1b``: Megatron's warmup count plus one,
      ``min(2 (p - 1 - s) + (v - 1) p + 1, v m)`` chunk activations on rank ``s``.
    * ``zb_h1``: ``p`` on every rank, counted until W; this is 1F1B's peak
      (rank 0's), the "same peak activation memory" of the paper. (Counted
      until B it is ``p - s``, exactly 1F1B's.)
    * ``zb_v``: ``2 p`` chunk activations (half a stage each) on every rank, counted
      until W: again 1F1B's peak of ``p`` stage activations.
    * ``dualpipe_v``: ``2 p + 1`` chunk activations on every rank, counted until W
      (DeepSeek-V3's ``PP + 1`` for DualPipe, ``PP = 2 p`` model stages).
    * ``looped_bfs``: ``v m`` chunk activations on every rank, as GPipe's ``m``.
    """
    p, m, v = tt.num_stages, tt.num_microbatches, tt.num_chunks
    if tt.name == "gpipe":
        return [m] * p
    if tt.name == "1f1b":  # with split_backward, W follows its B at once: the same
        return [min(p - s, m) for s in range(p)]
    if tt.name == "interleaved_1f1b":
        return [min(interleaved_warmup(p, m, v, s) + 1, v * m) for s in range(p)]
    if tt.name == "zb_h1":
        return [min(p, m)] * p
    if tt.name == "zb_v":
        return [min(2 * p, 2 * m)] * p
    if tt.name == "dualpipe_v":
        return [2 * p + 1] * p
    if tt.name == "looped_bfs":
        return [v * m] * p
    return None


def paper_bubble(tt: Timetable, costs: ActionCosts | None = None) -> float | None:
    """The idle time of each rank by the schedule's paper, in the units of ``costs``.

    * ``1f1b`` (whole backward): ``(p - 1) (F + B)``, Narayanan et al. (2021).
    * ``zb_h1``: ``(p - 1) (F + B - W)``, Qi et al. (2023).
    * ``dualpipe_v``: ``(PP / 2 - 1) (F&B + B - 3 W)`` of DeepSeek-V3 (2024, Table 2) with
      ``PP = 2 p`` model stages, ``F``, ``B`` and ``W`` one chunk's, and ``F&B`` a pair of one
      chunk's forward and the other's whole backward: ``F + B + W`` when the pair runs its
      parts one after another.

    Args:
      tt: The timetable.
      costs: The action costs (default :func:`jaxpg.pipeline.schedule.costs.default_costs`).

    Returns:
      The bubble per rank, or ``None`` for a schedule without a formula here.
    """
    c = costs or default_costs(tt)
    p = tt.num_stages
    if tt.name == "1f1b" and not tt.split_backward:
        return (p - 1) * (c.F + c.B)
    if tt.name == "zb_h1":
        return (p - 1) * (c.F + c.B - c.W)
    if tt.name == "dualpipe_v":
        pair = c.F + c.B + c.W
        return (p - 1) * (pair + c.B - 3 * c.W)  # PP / 2 - 1 = p - 1
    return None


def check_bubble(tt: Timetable, costs: ActionCosts | None = None) -> list[float]:
    """Raise ``ValueError`` if a rank idles longer than :func:`paper_bubble` says.

    The timetable is replayed event-driven with ``costs``
    (:func:`jaxpg.pipeline.schedule.costs.timed`, each rank in its timetable order, each
    action as soon as its inputs are done); a rank's idle time is the makespan less its work.

    Args:
      tt: The timetable; its name must have a formula (``1f1b``, ``zb_h1``, ``dualpipe_v``).
      costs: The action costs (default :func:`jaxpg.pipeline.schedule.costs.default_costs`).

    Returns:
      Each rank's idle time.

    Raises:
      ValueError: For a schedule without a formula, or naming the first rank over it.
    """
    bound = paper_bubble(tt, costs)
    if bound is None:
        raise ValueError(
            f"check_bubble has no bubble formula for schedule {tt.name!r}; it knows '1f1b' "
            "(whole backward), 'zb_h1' and 'dualpipe_v'."
        )
    replay = timed(tt, costs)
    idle = []
    for rank in range(tt.num_stages):
        work = sum(replay.costs.of(a.kind) for _, a in tt.actions_of(rank))
        idle.append(replay.makespan - work)
        if idle[-1] > bound + 1e-9 * max(1.0, replay.makespan):
            raise ValueError(
                f"Timetable {tt.name!r} idles {idle[-1]:g} on rank {rank} with {replay.costs}, "
                f"over its paper's bubble of {bound:g}."
            )
    return idle


def check_timetable(tt: Timetable, max_in_flight: int | Sequence[int] | None = None) -> None:
    """Raise ``ValueError`` unless ``tt`` is a correct, memory-bounded schedule.

    Checks, in this order:

    1. Every F and B (and W when ``tt.split_backward``) of every microbatch on
       every model stage appears exactly once.
    2. F on stage ``s`` runs in a strictly later tick than F on ``s - 1``; B on
       ``s`` after F on ``s`` and after B on ``s + 1``; W after B on ``s``
       (all for the same microbatch).
    3. No rank holds more activations than ``max_in_flight`` (see
       :func:`peak_in_flight`).

    Two actions on one rank in one tick cannot be written down: the grid has
    one cell per rank per tick.

    Args:
      tt: The timetable to check.
      max_in_flight: The bound, one int for all ranks or one per rank.
        Defaults to :func:`default_in_flight_limits` (no bound for a schedule
        name it does not know).

    Raises:
      ValueError: Naming the first action that is missing, duplicated, early,
        or over the memory bound.
    """
    p, m, n = tt.num_stages, tt.num_microbatches, tt.num_model_stages
    kinds = ("F", "B", "W") if tt.split_backward else ("F", "B")
    name = f"Timetable {tt.name!r}"

    when: dict[tuple[str, int, int], int] = {}
    for tick, row in enumerate(tt.grid):
        for rank, action in enumerate(row):
            if action is None:
                continue
            key = (action.kind, action.microbatch, tt.stage_of(rank, action.chunk))
            if key in when:
                raise ValueError(
                    f"{name} runs {_describe(tt, *key)} twice, at ticks {when[key]} and {tick}; "
                    "each action must run exactly once."
                )
            when[key] = tick
    for kind in kinds:
        for stage in range(n):
            for mb in range(m):
                if (kind, mb, stage) not in when:
                    raise ValueError(
                        f"{name} never runs {_describe(tt, kind, mb, stage)}; "
                        "each action must run exactly once."
                    )

    for (kind, mb, stage), tick in sorted(when.items(), key=lambda item: item[1]):
        for dep in dependencies(kind, mb, stage, n):
            if when[dep] >= tick:
                raise ValueError(
                    f"{name} runs {_describe(tt, kind, mb, stage)} at tick {tick}, but it needs "
                    f"{_describe(tt, *dep)}, which runs at tick {when[dep]}; an action may only "
                    "use results of strictly earlier ticks."
                )

    if max_in_flight is None:
        limits = default_in_flight_limits(tt)
        if limits is None:
            return
    elif isinstance(max_in_flight, int):
        limits = [max_in_flight] * p
    else:
        limits = list(max_in_flight)
        if len(limits) != p:
            raise ValueError(
                f"max_in_flight has {len(limits)} entries but the timetable has {p} ranks; "
                "give one int, or one per rank."
            )
    release = "W" if tt.split_backward else "B"
    for rank, limit in enumerate(limits):
        for tick, live in _live_counts(tt, rank, release):
            if live > limit:
                raise ValueError(
                    f"{name} keeps {live} activations in flight (F done, {release} not yet) on "
                    f"rank {rank} after tick {tick}, over its limit of {limit}; run a backward "
                    "earlier or raise max_in_flight."
                )
