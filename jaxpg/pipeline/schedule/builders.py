"""The pipeline schedules: GPipe, 1F1B, interleaved 1F1B, looped BFS, zero-bubble ZB-H1 and
ZB-V, and DualPipeV.

Each builder writes down, for every rank, the order in which the rank runs
its forward (F), backward (B) and weight-gradient (W) actions, and lets
:func:`jaxpg.pipeline.schedule._simulate.simulate` play the orders out in unit-time
ticks. The idle slots of the result are the schedule's bubble.

Theory, in ticks (every action is one tick):

====================  ===================  ===========================
schedule              ticks                bubble fraction
====================  ===================  ===========================
``gpipe``             ``2 (m + p - 1)``    ``(p - 1) / (m + p - 1)``
``1f1b``              ``2 (m + p - 1)``    ``(p - 1) / (m + p - 1)``
``interleaved_1f1b``  ``2 (v m + p - 1)``  ``(p - 1) / (v m + p - 1)``
``zb_h1``             ``3 m + p - 1``      ``(p - 1) / (3 m + p - 1)``
``zb_v``              ``6 m + p - 1``      ``(p - 1) / (6 m + p - 1)``
``dualpipe_v``        ``6 m + p - 1``      ``(p - 1) / (6 m + p - 1)``
``looped_bfs``        ``2 (v m + p - 1)``  ``(p - 1) / (v m + p - 1)``
====================  ===================  ===========================

For the interleaved schedule a tick is one chunk's F or B (``1/v`` of a full
stage), so its bubble fraction is in the Megatron paper's unit. For ZB-H1 F,
B and W each take a tick, the ``T_F = T_B = T_W`` case of Qi et al. (2023):
each rank idles ``p - 1`` ticks against 1F1B's ``3 (p - 1)`` (there the full
backward is ``B + W``, two ticks), a third of 1F1B's bubble. ZB-V runs two
chunks per rank in a V (a tick is one chunk's F, B or W, half a stage's), and
idles ``p - 1`` such half-ticks per rank for ``m >= 2 p``; for a small ``m`` its
bubble is larger (see ``bench/results/pipeline_bubbles.json``). DualPipeV runs the
same V with torch's ``ScheduleDualPipeV`` order, and idles the same ``p - 1`` half-ticks
(DeepSeek-V3's ``(PP / 2 - 1) (F&B + B - 3 W)`` at unit costs, ``PP = 2 p`` model stages:
see :func:`jaxpg.pipeline.schedule.checker.check_bubble`). Looped BFS runs every microbatch through
one chunk before the next, as GPipe runs them through its one stage.

Example:
    >>> from jaxpg.pipeline.schedule.builders import get_schedule
    >>> tt = get_schedule("interleaved_1f1b", p=4, m=8, v=2)
    >>> tt.num_ticks, round(tt.bubble_fraction, 4)
    (38, 0.1579)
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

from jaxpg.pipeline.schedule._simulate import simulate
from jaxpg.pipeline.schedule.timetable import Action, Timetable

__all__ = [
    "available_schedules",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "dualpipe_v",
    "interleaved_zero_bubble",
    "looped_bfs",
    "one_f_one_b",
    "theory_bubble_fraction",
    "theory_ticks",
    "zero_bubble_h1",
    "zero_bubble_v",
]


def _check_counts(schedule: str, p: int, m: int) -> tuple[int, int]:
    for arg, value, what in (("p", p, "pipeline stages"), ("m", m, "microbatches")):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(
                f"{schedule} needs a positive integer number of {what}, got {arg}={value!r}."
            )
    return int(p), int(m)


def gpipe(p: int, m: int) -> Timetable:
    """GPipe: every rank runs all ``m`` forwards, then all ``m`` backwards.

    Args:
      p: Pipeline stages (ranks).
      m: Microbatches, any ``m >= 1``.

    Returns:
      A :class:`Timetable` of ``2 (m + p - 1)`` ticks; stage ``s`` holds up to
      ``m`` activations at once.
    """
    p, m = _check_counts("gpipe", p, m)
    orders = [
        [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(p)
    ]
    return simulate("gpipe", orders, num_microbatches=m)


def _one_f_one_b_order(p: int, m: int, rank: int, warmup: int) -> list[Action]:
    warmup = min(warmup, m)
    order = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action("F", warmup + i), Action("B", i)]
    order += [Action("B", i) for i in range(m - warmup, m)]
    return order


def one_f_one_b(p: int, m: int, split_backward: bool = False) -> Timetable:
    """1F1B (PipeDream-flush): warmup forwards, one-forward-one-backward, cooldown.

    Rank ``s`` runs ``p - 1 - s`` warmup forwards, then alternates one forward
    and one backward, then drains the remaining backwards.

    Args:
      p: Pipeline stages (ranks).
      m: Microbatches, any ``m >= 1`` (with ``m < p`` it degenerates to GPipe).
      split_backward: Run each backward as ``B`` (input gradient) then, in the
        next free tick, ``W`` (weight gradient), so every tick is one forward
        long. Without remat this costs no extra work, removes the lockstep
        executor's wait of an ``F`` beside a whole ``B`` (``jaxpg.pipeline.schedule.costs``)
        and, as the ``W`` of a rank overlap the next rank's ``B``, takes
        ``3 m + 2 (p - 1)`` ticks against ``3 (m + p - 1)`` time units unsplit.

    Returns:
      A :class:`Timetable` of ``2 (m + p - 1)`` ticks (``3 m + 2 (p - 1)`` split);
      stage ``s`` holds at most ``min(p - s, m)`` activations at once, whatever
      ``m`` is.
    """
    p, m = _check_counts("one_f_one_b", p, m)
    if not isinstance(split_backward, bool):
        raise TypeError(f"split_backward={split_backward!r} must be True or False.")
    orders = [_one_f_one_b_order(p, m, r, p - 1 - r) for r in range(p)]
    if split_backward:
        orders = [
            [b for a in order for b in ([a, Action("W", a.microbatch)] if a.kind == "B" else [a])]
            for order in orders
        ]
    return simulate("1f1b", orders, num_microbatches=m, split_backward=split_backward)


def interleaved_warmup(p: int, m: int, v: int, rank: int) -> int:
    """Warmup forwards of rank ``rank`` in the interleaved schedule (Megatron's count)."""
    return min(2 * (p - 1 - rank) + (v - 1) * p, v * m)


def interleaved_1f1b(p: int, m: int, v: int) -> Timetable:
    """Megatron's interleaved 1F1B: ``v`` model chunks per rank, round robin.

    Chunk ``c`` on rank ``r`` is model stage ``c * p + r``. Microbatches go
    through the chunks in groups of ``p``: a rank runs the forwards of
    microbatches ``0..p-1`` on chunk 0, then the same ones on chunk 1, and so
    on, and the backwards in the same groups from the last chunk down. Rank
    ``r`` runs ``2 (p - 1 - r) + (v - 1) p`` warmup forwards, then alternates.

    Args:
      p: Pipeline stages (ranks).
      m: Microbatches; a multiple of ``p`` (so ``m >= p``).
      v: Model chunks per rank, ``v >= 2``.

    Returns:
      A :class:`Timetable` of ``2 (v m + p - 1)`` ticks of one chunk each.
    """
    p, m = _check_counts("interleaved_1f1b", p, m)
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 2:
        raise ValueError(
            f"interleaved_1f1b needs v >= 2 model chunks per rank, got v={v!r}; "
            "for one chunk per rank use one_f_one_b."
        )
    v = int(v)
    if m % p:
        nearest = [k * p for k in (m // p, m // p + 1) if k > 0]
        raise ValueError(
            f"interleaved_1f1b needs the number of microbatches m={m} to be a multiple of the "
            f"number of stages p={p}; use m={' or m='.join(map(str, nearest))}."
        )

    def forward(k: int) -> Action:
        return Action("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def backward(k: int) -> Action:
        return Action("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    total = v * m
    orders = []
    for rank in range(p):
        warmup = interleaved_warmup(p, m, v, rank)
        order = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [forward(warmup + k), backward(k)]
        order += [backward(k) for k in range(total - warmup, total)]
        orders.append(order)
    return simulate("interleaved_1f1b", orders, num_microbatches=m, num_chunks=v)


def interleaved_zero_bubble(p: int, m: int, v: int) -> Timetable:
    """Interleaved 1F1B with the backward split: each ``W`` right after its ``B``."""
    base = interleaved_1f1b(p, m, v)
    orders = [[b for _, a in base.actions_of(r) for b in (
        [a, Action("W", a.microbatch, a.chunk)] if a.kind == "B" else [a])]
        for r in range(p)]  # fmt: skip
    return simulate("interleaved_zb", orders, num_microbatches=m, num_chunks=v,
                    split_backward=True)


def zero_bubble_h1(p: int, m: int) -> Timetable:
    """ZB-H1 of "Zero Bubble Pipeline Parallelism" (Qi et al., 2023).

    The backward is split into ``B`` (input gradient, on the critical path)
    and ``W`` (weight gradient, free to wait). Forwards and ``B`` follow 1F1B;
    rank ``r`` delays its weight gradients by ``r`` microbatches (it starts
    ``W`` after its ``(r + 1)``-th ``B``), so the ``W`` left over at the end fill
    the cooldown bubble of 1F1B. Stage ``s`` keeps at most ``p - s``
    microbatches between F and B, as 1F1B, and at most ``p`` between F and W.

    Args:
      p: Pipeline stages (ranks).
      m: Microbatches, ``m >= p``.

    Returns:
      A :class:`Timetable` with ``split_backward=True`` of ``3 m + p - 1`` ticks.
    """
    p, m = _check_counts("zero_bubble_h1", p, m)
    if m < p:
        raise ValueError(
            f"zero_bubble_h1 needs at least as many microbatches as stages, got m={m} < p={p}; "
            f"use m >= {p}."
        )
    orders = []
    for rank in range(p):
        order, weights = [], 0
        for action in _one_f_one_b_order(p, m, rank, p - 1 - rank):
            order.append(action)
            if action.kind == "B" and action.microbatch >= rank:
                order.append(Action("W", weights))
                weights += 1
        order += [Action("W", i) for i in range(weights, m)]
        orders.append(order)
    return simulate("zb_h1", orders, num_microbatches=m, split_backward=True)


def _zbv_order(p: int, m: int, rank: int) -> list[Action]:
    """Rank ``rank``'s actions in torch's ``ScheduleZBVZeroBubble`` order (``B`` = its ``I``)."""
    n = max(2 * p - 1, m)  # torch pads to 2p - 1 microbatches and drops the extra ones
    order: list[Action] = []
    f0 = f1 = b0 = b1 = 0

    def add(kind: str, mb: int, chunk: int) -> None:
        order.append(Action(kind, mb, chunk))

    for _ in range(2 * (p - rank) - 1):
        add("F", f0, 0)
        f0 += 1
    for _ in range(rank):
        add("F", f1, 1)
        add("F", f0, 0)
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(p - rank):
        add("F", f1, 1)
        add("B", b1, 1)
        add("W", b1, 1)
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            add("F", f0, 0)
            f0 += 1
        add("B", b0, 0)
        add("W", b0, 0)
        add("F", f1, 1)
        add("B", b1, 1)
        add("W", b1, 1)
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(rank):
        add("B", b0, 0)
        add("B", b1, 1)
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(p - rank):
        add("B", b0, 0)
        add("W", w0, 0)
        b0, w0 = b0 + 1, w0 + 1
    order += [Action("W", i, 1) for i in range(w1, b1)]
    order += [Action("W", i, 0) for i in range(w0, b0)]
    return [a for a in order if a.microbatch < m]


def zero_bubble_v(p: int, m: int) -> Timetable:
    """ZB-V of Qi et al. (2023), in the order of torch's ``ScheduleZBVZeroBubble``.

    Two chunks per rank in a V: chunk 0 of rank ``r`` is model stage ``r`` and
    chunk 1 is stage ``2 p - 1 - r`` (``layout="v"``), so the forward goes down
    the ranks and back up and the loss is on rank 0. The backward is split into
    ``B`` (input gradient) and ``W`` (weight gradient), and the ``W`` fill the
    bubbles. Every action is one chunk's work (half a stage).

    Args:
      p: Pipeline stages (ranks); the model has ``2 p`` stages.
      m: Microbatches, any ``m >= 1`` (the bubble is smallest for ``m >= 2 p``).

    Returns:
      A :class:`Timetable` with ``num_chunks=2``, ``layout="v"`` and
      ``split_backward=True``.
    """
    p, m = _check_counts("zero_bubble_v", p, m)
    orders = [_zbv_order(p, m, r) for r in range(p)]
    return simulate(
        "zb_v", orders, num_microbatches=m, num_chunks=2, split_backward=True, layout="v"
    )


def looped_bfs(p: int, m: int, v: int) -> Timetable:
    """Breadth-first looped pipeline (Lamy-Poirier, 2022), torch's ``ScheduleLoopedBFS``.

    ``v`` chunks per rank in a loop (chunk ``c`` of rank ``r`` is model stage ``c p + r``,
    as interleaved 1F1B). Each rank runs every microbatch's forward on chunk 0, then on
    chunk 1, and so on; then the backwards from the last chunk down, the microbatches
    in reverse order (the last microbatch's first), as torch's order has them.

    Args:
      p: Pipeline stages (ranks).
      m: Microbatches, any ``m >= 1``.
      v: Model chunks per rank, ``v >= 1`` (one chunk is GPipe with the backwards reversed).

    Returns:
      A :class:`Timetable` of ``2 (v m + p - 1)`` ticks of one chunk each; a rank holds
      up to ``v m`` chunk activations at once, as GPipe holds ``m``.
    """
    p, m = _check_counts("looped_bfs", p, m)
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise ValueError(f"looped_bfs needs v >= 1 model chunks per rank, got v={v!r}.")
    v = int(v)
    order = [Action("F", i, c) for c in range(v) for i in range(m)]
    order += [Action("B", i, c) for c in reversed(range(v)) for i in reversed(range(m))]
    return simulate("looped_bfs", [order] * p, num_microbatches=m, num_chunks=v)


def _dualpipe_v_order(p: int, m: int, rank: int) -> list[Action]:
    """Rank ``rank``'s actions in torch's ``ScheduleDualPipeV`` order.

    torch's full backward is ``B`` then ``W`` here; its overlapped pair (``OVERLAP_F_B``:
    one chunk's forward and the other chunk's full backward) is the forward, then the
    backward's ``B`` and ``W``, the order in which torch's runtime runs the pair's parts.
    """
    order: list[Action] = []
    count = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
    weights: list[Action] = []  # the W of split backwards, oldest first

    def forward(chunk: int) -> None:
        order.append(Action("F", count["F", chunk], chunk))
        count["F", chunk] += 1

    def backward(chunk: int, full: bool = True) -> None:
        mb = count["B", chunk]
        count["B", chunk] += 1
        order.append(Action("B", mb, chunk))
        (order if full else weights).append(Action("W", mb, chunk))

    def weight() -> None:
        if weights:
            order.append(weights.pop(0))

    def pair(forward_chunk: int) -> None:  # torch's OVERLAP_F_B
        forward(forward_chunk)
        backward(1 - forward_chunk)

    for _ in range(2 * (p - rank - 1)):
        forward(0)
    for _ in range(rank + 1):
        forward(0)
        forward(1)
    for _ in range(p - rank - 1):  # zero bubble: B, W, F on chunk 1
        backward(1, full=False)
        weight()
        forward(1)
    for i in range(m - 2 * p + rank + 1):  # the steady state: two overlapped pairs
        if i == 0 and rank == p - 1:
            forward(0)  # torch runs the turn of the V's first pair unpaired
            backward(1)
        else:
            pair(0)
        pair(1)
    for _ in range(p - rank - 1):
        backward(1)
        pair(1)
    split, steps = False, rank + 1
    for i in range(steps):  # the second half of the backwards split, as zero bubble
        split = split or (i == steps // 2 and rank % 2 == 1)
        backward(1, full=not split)
        split = split or (i == steps // 2 and rank % 2 == 0)
        backward(0, full=not split)
    for _ in range(p - rank - 1):
        weight()
        backward(0, full=not split)
    while weights:
        weight()
    return order


def dualpipe_v(p: int, m: int) -> Timetable:
    """DualPipeV: DeepSeek's DualPipe in its V layout, in torch's ``ScheduleDualPipeV`` order.

    Two chunks per rank in a V, as ZB-V (``layout="v"``: chunk 0 of rank ``r`` is model
    stage ``r``, chunk 1 is stage ``2 p - 1 - r``). In its steady state every rank runs
    pairs: one chunk's forward of one microbatch beside the other chunk's backward of
    another, which DualPipe overlaps (one's communication under the other's compute).
    The pair is written as its forward, then the backward's ``B`` and ``W`` in the next
    ticks; the backwards before and after the steady state split into ``B`` and a later
    ``W`` that fills the bubble, as zero bubble does. Each rank idles ``p - 1`` ticks
    (half a stage each), DeepSeek-V3's ``(PP / 2 - 1) (F&B + B - 3 W)`` at unit costs.

    Args:
      p: Pipeline stages (ranks); the model has ``2 p`` stages.
      m: Microbatches, ``m >= 2 p`` (torch's rule: at least as many as model stages).

    Returns:
      A :class:`Timetable` with ``num_chunks=2``, ``layout="v"`` and
      ``split_backward=True``, of ``6 m + p - 1`` ticks; a rank holds at most ``2 p + 1``
      chunk activations, counted until ``W``.
    """
    p, m = _check_counts("dualpipe_v", p, m)
    if m < 2 * p:
        raise ValueError(
            f"dualpipe_v needs at least as many microbatches as model stages (2 p = {2 * p}), "
            f"as torch's ScheduleDualPipeV does, got m={m} with p={p}; use m >= {2 * p}."
        )
    orders = [_dualpipe_v_order(p, m, r) for r in range(p)]
    return simulate(
        "dualpipe_v", orders, num_microbatches=m, num_chunks=2, split_backward=True, layout="v"
    )


_BUILDERS: dict[str, Callable[..., Timetable]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": zero_bubble_h1,
    "zb_v": zero_bubble_v,
    "dualpipe_v": dualpipe_v,
    "looped_bfs": looped_bfs,
}


def available_schedules() -> tuple[str, ...]:
    """The names :func:`get_schedule` knows."""
    return tuple(_BUILDERS)


def get_schedule(name: str, p: int, m: int, v: int = 1) -> Timetable:
    """Build the schedule called ``name`` for ``p`` stages and ``m`` microbatches.

    Args:
      name: One of ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zb_h1"``,
        ``"zb_v"``, ``"dualpipe_v"``, ``"looped_bfs"``.
      p: Pipeline stages (ranks).
      m: Microbatches.
      v: Model chunks per rank; ``"interleaved_1f1b"`` takes ``v >= 2``, ``"looped_bfs"``
        ``v >= 1``, ``"zb_v"`` and ``"dualpipe_v"`` run two chunks (``v`` 1 or 2 both mean
        their fixed two), the others one.

    Returns:
      The schedule's :class:`Timetable`.
    """
    if name not in _BUILDERS:
        raise ValueError(f"Unknown schedule name={name!r}; choose one of {available_schedules()}.")
    if name in ("interleaved_1f1b", "looped_bfs"):
        return _BUILDERS[name](p, m, v)
    if name in ("zb_v", "dualpipe_v"):
        if v not in (1, 2):
            raise ValueError(f"Schedule {name!r} runs exactly two chunks per rank, got v={v!r}.")
        return _BUILDERS[name](p, m)
    if v != 1:
        raise ValueError(
            f"Schedule {name!r} runs one model chunk per rank, got v={v!r}; "
            "use 'interleaved_1f1b' for v > 1 or leave v=1."
        )
    return _BUILDERS[name](p, m)


def theory_ticks(name: str, p: int, m: int, v: int = 1) -> int:
    """The number of ticks the papers' formulas give for schedule ``name``."""
    if name in ("gpipe", "1f1b"):
        return 2 * (m + p - 1)
    if name in ("interleaved_1f1b", "looped_bfs"):
        return 2 * (v * m + p - 1)
    if name == "zb_h1":
        return 3 * m + p - 1
    if name in ("zb_v", "dualpipe_v"):
        return 6 * m + p - 1
    raise ValueError(f"Unknown schedule name={name!r}; choose one of {available_schedules()}.")


def theory_bubble_fraction(name: str, p: int, m: int, v: int = 1) -> float:
    """Idle over total rank-time by the papers' formulas (see the module table)."""
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name in ("interleaved_1f1b", "looped_bfs"):
        return (p - 1) / (v * m + p - 1)
    if name == "zb_h1":
        return (p - 1) / (3 * m + p - 1)
    if name in ("zb_v", "dualpipe_v"):
        return (p - 1) / (6 * m + p - 1)
    raise ValueError(f"Unknown schedule name={name!r}; choose one of {available_schedules()}.")
