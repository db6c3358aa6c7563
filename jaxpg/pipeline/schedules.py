"""The pipeline schedules: GPipe, 1F1B, interleaved 1F1B and zero-bubble ZB-H1.

Each builder writes down, for every rank, the order in which the rank runs
its forward (F), backward (B) and weight-gradient (W) actions, and lets
:func:`jaxpg.pipeline._simulate.simulate` play the orders out in unit-time
ticks. The idle slots of the result are the schedule's bubble.

Theory, in ticks (every action is one tick):

====================  ===================  ===========================
schedule              ticks                bubble fraction
====================  ===================  ===========================
``gpipe``             ``2 (m + p - 1)``    ``(p - 1) / (m + p - 1)``
``1f1b``              ``2 (m + p - 1)``    ``(p - 1) / (m + p - 1)``
``interleaved_1f1b``  ``2 (v m + p - 1)``  ``(p - 1) / (v m + p - 1)``
``zb_h1``             ``3 m + p - 1``      ``(p - 1) / (3 m + p - 1)``
====================  ===================  ===========================

For the interleaved schedule a tick is one chunk's F or B (``1/v`` of a full
stage), so its bubble fraction is in the Megatron paper's unit. For ZB-H1 F,
B and W each take a tick, the ``T_F = T_B = T_W`` case of Qi et al. (2023):
each rank idles ``p - 1`` ticks against 1F1B's ``3 (p - 1)`` (there the full
backward is ``B + W``, two ticks), a third of 1F1B's bubble.

Example:
    >>> from jaxpg.pipeline.schedules import get_schedule
    >>> tt = get_schedule("interleaved_1f1b", p=4, m=8, v=2)
    >>> tt.num_ticks, round(tt.bubble_fraction, 4)
    (38, 0.1579)
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

from jaxpg.pipeline._simulate import simulate
from jaxpg.pipeline.timetable import Action, Timetable

__all__ = [
    "available_schedules",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "theory_bubble_fraction",
    "theory_ticks",
    "zero_bubble_h1",
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


def one_f_one_b(p: int, m: int) -> Timetable:
    """1F1B (PipeDream-flush): warmup forwards, one-forward-one-backward, cooldown.

    Rank ``s`` runs ``p - 1 - s`` warmup forwards, then alternates one forward
    and one backward, then drains the remaining backwards.

    Args:
      p: Pipeline stages (ranks).
      m: Microbatches, any ``m >= 1`` (with ``m < p`` it degenerates to GPipe).

    Returns:
      A :class:`Timetable` of ``2 (m + p - 1)`` ticks; stage ``s`` holds at
      most ``min(p - s, m)`` activations at once, whatever ``m`` is.
    """
    p, m = _check_counts("one_f_one_b", p, m)
    orders = [_one_f_one_b_order(p, m, r, p - 1 - r) for r in range(p)]
    return simulate("1f1b", orders, num_microbatches=m)


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


_BUILDERS: dict[str, Callable[..., Timetable]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": zero_bubble_h1,
}


def available_schedules() -> tuple[str, ...]:
    """The names :func:`get_schedule` knows."""
    return tuple(_BUILDERS)


def get_schedule(name: str, p: int, m: int, v: int = 1) -> Timetable:
    """Build the schedule called ``name`` for ``p`` stages and ``m`` microbatches.

    Args:
      name: One of ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zb_h1"``.
      p: Pipeline stages (ranks).
      m: Microbatches.
      v: Model chunks per rank; only ``"interleaved_1f1b"`` takes ``v > 1``.

    Returns:
      The schedule's :class:`Timetable`.
    """
    if name not in _BUILDERS:
        raise ValueError(f"Unknown schedule name={name!r}; choose one of {available_schedules()}.")
    if name == "interleaved_1f1b":
        return interleaved_1f1b(p, m, v)
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
    if name == "interleaved_1f1b":
        return 2 * (v * m + p - 1)
    if name == "zb_h1":
        return 3 * m + p - 1
    raise ValueError(f"Unknown schedule name={name!r}; choose one of {available_schedules()}.")


def theory_bubble_fraction(name: str, p: int, m: int, v: int = 1) -> float:
    """Idle over total rank-time by the papers' formulas (see the module table)."""
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    if name == "zb_h1":
        return (p - 1) / (3 * m + p - 1)
    raise ValueError(f"Unknown schedule name={name!r}; choose one of {available_schedules()}.")
