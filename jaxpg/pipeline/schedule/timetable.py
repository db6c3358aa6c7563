"""A pipeline schedule as data: which action every rank runs at every tick.

A :class:`Timetable` is a grid ``grid[tick][rank]`` of :class:`Action` (or
``None`` for an idle slot). It is made in plain Python by the schedule
builders in :mod:`jaxpg.pipeline.schedule.builders`, checked by
:func:`jaxpg.pipeline.schedule.checker.check_timetable`, and executed by one SPMD loop.

Vocabulary:

* ``p`` (``num_stages``) pipeline ranks; ``v`` (``num_chunks``) model chunks
  per rank, so the model has ``v * p`` *model stages*. With ``layout="loop"``
  chunk ``c`` on rank ``r`` is model stage ``c * p + r`` (Megatron's
  interleaved layout); with ``layout="v"`` (two chunks, ZB-V) chunk 0 on rank
  ``r`` is stage ``r`` and chunk 1 is stage ``2 p - 1 - r``, so the model goes
  down the ranks and back up (the last stage is on rank 0).
* ``m`` (``num_microbatches``) microbatches, numbered ``0 .. m-1``.
* Kinds: ``"F"`` forward; ``"B"`` backward (the input gradient only when
  ``split_backward`` is true, else the whole backward); ``"W"`` the weight
  gradient (only when ``split_backward``).

Every action takes one tick. The output of an action reaches its neighbour
stage in time for the *next* tick, never the same one.

Example:
    >>> from jaxpg.pipeline.schedule.builders import one_f_one_b
    >>> tt = one_f_one_b(2, 2)
    >>> tt.num_ticks, tt.bubble_fraction
    (6, 0.3333333333333333)
    >>> print(tt.to_text(header=False))
    rank 0 | F0 F1 .  B0 .  B1
    rank 1 | .  F0 B0 F1 B1 .
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = [
    "Action", "KIND_CODES", "LAYOUTS", "Timetable", "model_stage", "render_grid",
    "timetable_title",
]  # fmt: skip

#: Stage layouts: how (rank, chunk) maps to a model stage; see :func:`model_stage`.
LAYOUTS = ("loop", "v")


def model_stage(layout: str, num_stages: int, rank: int, chunk: int) -> int:
    """The model stage held by chunk ``chunk`` of rank ``rank`` under ``layout``.

    ``"loop"``: ``chunk * p + rank``. ``"v"``: ``rank`` for chunk 0 and
    ``2 p - 1 - rank`` for chunk 1.
    """
    if layout == "v":
        return rank if chunk == 0 else (chunk + 1) * num_stages - 1 - rank
    return chunk * num_stages + rank

#: Integer codes of the action kinds in :meth:`Timetable.as_arrays`; 0 is idle.
#: An action kind (None for idle) -> the integer code of the executor's tick tables.
KIND_CODES: dict[str | None, int] = {None: 0, "F": 1, "B": 2, "W": 3}


class Action(NamedTuple):
    """One unit of work on one rank in one tick.

    Attributes:
      kind: ``"F"`` forward, ``"B"`` backward (input gradient when the schedule
        splits the backward, else the whole backward), ``"W"`` weight gradient.
      microbatch: The microbatch, ``0 .. m-1``.
      chunk: The virtual stage on this rank, ``0 .. v-1``; the model stage is
        ``chunk * num_stages + rank``.
    """

    kind: str
    microbatch: int
    chunk: int = 0

    def label(self, num_chunks: int = 1) -> str:
        """A short cell label such as ``F3`` (or ``F3b`` for chunk 1 of several)."""
        suffix = chr(ord("a") + self.chunk) if num_chunks > 1 else ""
        return f"{self.kind}{self.microbatch}{suffix}"


@dataclass(frozen=True)
class Timetable:
    """Which :class:`Action` each pipeline rank runs at each tick.

    Attributes:
      name: The schedule's name (``"1f1b"``, ``"gpipe"``, ...).
      num_stages: ``p``, the number of pipeline ranks.
      num_microbatches: ``m``.
      num_chunks: ``v``, model chunks per rank (1 except interleaved schedules).
      split_backward: Whether the backward is split into ``B`` (input
        gradient) and ``W`` (weight gradient). If false there is no ``W``.
      grid: ``grid[tick][rank]``, an :class:`Action` or ``None`` (idle). Lists
        are accepted and stored as tuples.
      layout: ``"loop"`` or ``"v"``, how chunks map to model stages
        (:func:`model_stage`).
    """

    name: str
    num_stages: int
    num_microbatches: int
    num_chunks: int
    split_backward: bool
    grid: tuple[tuple[Action | None, ...], ...]
    layout: str = "loop"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"Timetable layout={self.layout!r} must be one of {LAYOUTS}.")
        if self.layout == "v" and self.num_chunks != 2:
            raise ValueError(
                f"Timetable layout='v' needs num_chunks=2, got num_chunks={self.num_chunks!r}."
            )
        for field in ("num_stages", "num_microbatches", "num_chunks"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"Timetable {field}={value!r} must be a positive integer.")
        if not isinstance(self.split_backward, bool):
            raise TypeError(
                f"Timetable split_backward={self.split_backward!r} must be True or False."
            )
        if isinstance(self.grid, str) or not hasattr(self.grid, "__iter__"):
            raise TypeError(
                f"Timetable grid must be a sequence of ticks, got {type(self.grid).__name__}."
            )
        grid = tuple(tuple(row) for row in self.grid)
        object.__setattr__(self, "grid", grid)
        kinds = ("F", "B", "W") if self.split_backward else ("F", "B")
        p, m, v = self.num_stages, self.num_microbatches, self.num_chunks
        for tick, row in enumerate(grid):
            if len(row) != p:
                raise ValueError(
                    f"Timetable grid[{tick}] has {len(row)} entries but num_stages={p}; "
                    "every tick needs one entry (an Action or None) per rank."
                )
            for rank, action in enumerate(row):
                if action is None:
                    continue
                where = f"grid[{tick}][{rank}]={action!r}"
                if not isinstance(action, Action):
                    raise TypeError(f"Timetable {where} must be an Action or None.")
                if action.kind not in kinds:
                    hint = "" if self.split_backward else " (W needs split_backward=True)"
                    raise ValueError(f"Timetable {where} has a kind not in {kinds}{hint}.")
                if not 0 <= action.microbatch < m:
                    raise ValueError(
                        f"Timetable {where} has a microbatch outside 0..{m - 1} "
                        f"(num_microbatches={m})."
                    )
                if not 0 <= action.chunk < v:
                    raise ValueError(
                        f"Timetable {where} has a chunk outside 0..{v - 1} (num_chunks={v})."
                    )

    @property
    def num_ticks(self) -> int:
        """The number of ticks (columns) of the timetable."""
        return len(self.grid)

    @property
    def num_model_stages(self) -> int:
        """``num_chunks * num_stages``, the number of pieces the model is cut into."""
        return self.num_chunks * self.num_stages

    def stage_of(self, rank: int, chunk: int) -> int:
        """The model stage that chunk ``chunk`` on rank ``rank`` holds."""
        return model_stage(self.layout, self.num_stages, rank, chunk)

    def place_of(self, stage: int) -> tuple[int, int]:
        """``(rank, chunk)`` that holds model stage ``stage``."""
        p = self.num_stages
        chunk = stage // p
        rank = stage % p if self.layout == "loop" or chunk == 0 else p - 1 - stage % p
        return rank, chunk

    def actions_of(self, rank: int) -> list[tuple[int, Action]]:
        """The ``(tick, action)`` pairs of one rank, in tick order, idle ticks left out."""
        if not 0 <= rank < self.num_stages:
            raise ValueError(f"rank={rank} must be in 0..{self.num_stages - 1}.")
        return [(t, row[rank]) for t, row in enumerate(self.grid) if row[rank] is not None]

    def idle_ticks(self, rank: int) -> int:
        """How many ticks rank ``rank`` spends idle."""
        return self.num_ticks - len(self.actions_of(rank))

    @property
    def bubble_fraction(self) -> float:
        """Idle rank-ticks over all rank-ticks.

        Every action counts as one tick of work, whatever its kind. For the
        interleaved schedule a tick is one chunk's F or B, i.e. ``1/v`` of a
        full stage, which is the unit the Megatron paper uses; for zero-bubble
        schedules F, B and W each take one tick (the ``T_F = T_B = T_W`` case of
        the paper).
        """
        total = self.num_ticks * self.num_stages
        if total == 0:
            return 0.0
        busy = sum(a is not None for row in self.grid for a in row)
        return (total - busy) / total

    def as_arrays(self) -> dict[str, np.ndarray]:
        """The grid as int32 arrays of shape ``[num_ticks, num_stages]``.

        Returns:
          A dict with ``"kind"`` (0 idle, 1 F, 2 B, 3 W, see :data:`KIND_CODES`),
          ``"microbatch"``, ``"chunk"`` and ``"stage"`` (the model stage).
          Idle cells hold 0 in every array but ``"kind"``, so the arrays can be
          used as indices directly; mask them with ``kind != 0``.
        """
        shape = (self.num_ticks, self.num_stages)
        out = {key: np.zeros(shape, np.int32) for key in ("kind", "microbatch", "chunk", "stage")}
        for t, row in enumerate(self.grid):
            for r, a in enumerate(row):
                if a is not None:
                    out["kind"][t, r] = KIND_CODES[a.kind]
                    out["microbatch"][t, r] = a.microbatch
                    out["chunk"][t, r] = a.chunk
                    out["stage"][t, r] = self.stage_of(r, a.chunk)
        return out

    def to_text(self, header: bool = True) -> str:
        """The grid as text: one row per rank, one column per tick, ``.`` for idle.

        Cells read ``F3``, ``B3``, ``W3``; with several chunks a letter names
        the chunk (``F3a`` is chunk 0, ``F3b`` chunk 1).
        """
        return render_grid(self, header=header)

    def __str__(self) -> str:
        return self.to_text()


def timetable_title(tt: Timetable) -> str:
    return (
        f"{tt.name}: p={tt.num_stages} m={tt.num_microbatches} v={tt.num_chunks}, "
        f"{tt.num_ticks} ticks, bubble {tt.bubble_fraction:.1%}"
    )


def render_grid(tt: Timetable, header: bool = True) -> str:
    """The timetable as a fixed-width text grid, one line per rank.

    Args:
      tt: The timetable.
      header: Whether to start with a title line and a line of tick numbers.

    Returns:
      The grid as a string, without a trailing newline.
    """
    cells = [
        ["." if a is None else a.label(tt.num_chunks) for a in (row[r] for row in tt.grid)]
        for r in range(tt.num_stages)
    ]
    width = max([2] + [len(c) for line in cells for c in line])
    prefix = f"rank {tt.num_stages - 1}"
    lines = []
    if header:
        ticks = [str(t) if len(str(t)) <= width else "" for t in range(tt.num_ticks)]
        lines += [timetable_title(tt), "tick".ljust(len(prefix)) + " | " + _join(ticks, width)]
    for r, line in enumerate(cells):
        lines.append(f"rank {r}".ljust(len(prefix)) + " | " + _join(line, width))
    return "\n".join(lines)


def _join(cells: list[str], width: int) -> str:
    return " ".join(c.ljust(width) for c in cells).rstrip()
