"""The buffer plan: a timetable turned into per-tick, per-rank integer instructions.

The executor (``executor.py``) runs one ``lax.scan`` over the ticks of a timetable. At
each tick, every rank reads one row of integers from the tables made here: which
branch to run (idle, a forward, a backward, a weight-gradient step, with first/last
stage variants), the microbatch, the chunk, which buffer slots to read, and where to
store what the neighbours sent it at the end of the tick.

Two bounded buffers live on each rank, both holding one activation per slot:

* ``act``: stage *input* activations. A slot is taken when a forward message arrives
  from the previous rank (or, on the first model stage, when the forward computes the
  embedding), and released by the backward (``B``) that consumes it, or by the
  weight-gradient step (``W``) when the schedule splits the backward.
* ``grad``: output gradients. A slot is taken when a backward message arrives from the
  next rank (or, on the last model stage, when the forward computes ``d(loss/m)``), and
  released by ``B`` (or ``W`` when split).

Slots are assigned offline by simulating the timetable with a lowest-free-slot
allocator, so each buffer holds exactly as many slots as the schedule ever keeps alive
on the busiest rank. For 1F1B this is about ``p`` and does not grow with the number of
microbatches ``m``; for GPipe it is ``m``.

Simulating the timetable also checks it: every action must find its inputs produced in
an earlier tick, and every (stage, microbatch) must run ``F`` and ``B`` (and ``W`` when
split) exactly once; otherwise a ``ValueError`` names the action, tick and rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["BufferPlan", "plan_buffers", "BRANCHES"]

# Branch names, in a fixed order; the executor builds one function per name used.
BRANCHES = (
    "idle",
    "F",  # forward, middle stage: read input from act, send output forward
    "F_first",  # forward, first model stage: embed the microbatch into act first
    "F_last",  # forward, last model stage: head + loss, seed d(loss/m) into grad
    "F_first_last",  # forward when the model has a single stage
    "B",  # full backward (input and weight gradient)
    "B_first",  # full backward on the first stage (also the embedding's gradient)
    "B_input",  # split backward: input gradient only
    "B_input_first",  # split backward on the first stage (also the embedding's gradient)
    "W",  # split backward: weight gradient
)

# Columns of BufferPlan.table. A message arrives from rank r - 1 ("up", through the +1
# ring ppermute), from rank r + 1 ("down", the -1 ring), or from the rank itself
# ("local": the turn of a V-shaped layout); each goes to an act or a grad slot.
(BRANCH, MB, CHUNK, ACT, GRAD, UP_ACT, UP_GRAD, DOWN_ACT, DOWN_GRAD, LOCAL_ACT,
 LOCAL_GRAD) = range(11)  # fmt: skip
NUM_COLUMNS = 11


@dataclasses.dataclass(frozen=True)
class BufferPlan:
    """Integer instructions for the executor, made once per timetable.

    Attributes:
        table: int32 array ``[ticks, ranks, 11]``; columns are the branch index into
            ``branches``, microbatch, chunk, act slot, grad slot, then where the messages
            received at the end of the tick are stored (``-1``: nowhere): the act and grad
            slot for the message from rank ``r - 1`` ("up"), from rank ``r + 1``
            ("down") and from the rank itself ("local", the turn of a V layout).
        branches: the branch names used, indexed by the table's first column.
        num_act_slots: slots in each rank's stage-input activation buffer.
        num_grad_slots: slots in each rank's output-gradient buffer.
    """

    table: np.ndarray
    branches: tuple[str, ...]
    num_act_slots: int
    num_grad_slots: int

    def uses(self, column: int) -> bool:
        """Whether any tick stores into the slots named by ``column`` (an arrival column)."""
        return bool((self.table[..., column] >= 0).any())


class _Slots:
    """Lowest-free-slot allocator for one buffer on one rank."""

    def __init__(self) -> None:
        self.used: set[int] = set()
        self.peak = 0

    def take(self) -> int:
        slot = next(i for i in range(len(self.used) + 1) if i not in self.used)
        self.used.add(slot)
        self.peak = max(self.peak, len(self.used))
        return slot

    def free(self, slot: int) -> None:
        self.used.discard(slot)


def _describe(kind: str, mb: int, stage: int, tick: int, rank: int) -> str:
    return f"{kind}(microbatch={mb}, stage={stage}) at tick {tick} on rank {rank}"


def _arrival_column(buffer: str, source: int, dest: int, p: int, name: str) -> int:
    """The table column where ``dest`` stores a ``buffer`` message sent by ``source``."""
    act = buffer == "act"
    if source == dest:
        return LOCAL_ACT if act else LOCAL_GRAD
    if dest == (source + 1) % p:
        return UP_ACT if act else UP_GRAD
    if dest == (source - 1) % p:
        return DOWN_ACT if act else DOWN_GRAD
    raise ValueError(  # pragma: no cover - both layouts only talk to neighbours
        f"Timetable {name!r} sends from rank {source} to rank {dest}, which is not a neighbour."
    )


def plan_buffers(timetable: Any) -> BufferPlan:
    """Simulates ``timetable`` and assigns buffer slots; see the module docstring.

    Args:
        timetable: a ``Timetable`` (``grid[tick][rank]`` of ``Action`` or ``None``, with
            ``num_stages``, ``num_microbatches``, ``num_chunks`` and ``split_backward``).

    Returns:
        The ``BufferPlan`` the executor runs.

    Raises:
        ValueError: if an action's input was not produced in an earlier tick, or an
            action is missing or repeated.
    """
    p, m = timetable.num_stages, timetable.num_microbatches
    v, split = timetable.num_chunks, timetable.split_backward
    num_model_stages = p * v
    grid = timetable.grid
    ticks = len(grid)
    table = np.full((ticks, p, NUM_COLUMNS), -1, dtype=np.int32)
    table[:, :, BRANCH] = 0
    table[:, :, CHUNK] = 0
    act_slots = [_Slots() for _ in range(p)]
    grad_slots = [_Slots() for _ in range(p)]
    act_of: dict[tuple[int, int], tuple[int, int]] = {}  # (stage, mb) -> (slot, ready tick)
    grad_of: dict[tuple[int, int], tuple[int, int]] = {}
    done: set[tuple[str, int, int]] = set()
    names = ["idle"]

    def need(store: dict, key: tuple[int, int], what: str, tick: int) -> int:
        if key not in store or store[key][1] >= tick:
            raise ValueError(
                f"Timetable {timetable.name!r} is not executable: {what} needs "
                f"{'an activation' if store is act_of else 'an output gradient'} that no "
                "earlier tick produced. Check the schedule's dependencies "
                "(jaxpg.pipeline.schedule.checker)."
            )
        return store[key][0]

    for tick, row in enumerate(grid):
        if len(row) != p:
            raise ValueError(f"Timetable row {tick} has {len(row)} entries; expected {p}.")
        arrivals = []  # applied after every rank's action of this tick
        for rank, action in enumerate(row):
            if action is None:
                continue
            kind, mb, chunk = action.kind, action.microbatch, action.chunk
            stage = timetable.stage_of(rank, chunk)
            what = _describe(kind, mb, stage, tick, rank)
            if not (0 <= mb < m and 0 <= chunk < v) or kind not in ("F", "B", "W"):
                raise ValueError(f"Timetable {timetable.name!r} has an invalid action {what}.")
            if (kind, stage, mb) in done:
                raise ValueError(f"Timetable {timetable.name!r} repeats {what}.")
            if kind == "W" and not split:
                raise ValueError(
                    f"Timetable {timetable.name!r} has {what} but split_backward=False."
                )
            done.add((kind, stage, mb))
            first, last = stage == 0, stage == num_model_stages - 1
            entry = table[tick, rank]
            entry[MB], entry[CHUNK] = mb, chunk
            if kind == "F":
                name = "F" + ("_first" if first else "") + ("_last" if last else "")
                if first:
                    slot = act_slots[rank].take()
                    act_of[(stage, mb)] = (slot, tick - 1)
                entry[ACT] = need(act_of, (stage, mb), what, tick)
                if last:
                    grad_of[(stage, mb)] = (grad_slots[rank].take(), tick - 1)
                    entry[GRAD] = grad_of[(stage, mb)][0]
                else:
                    arrivals.append(("act", rank, (stage + 1, mb)))
            else:
                if kind == "W":
                    name, before = "W", "B"
                else:
                    name = ("B_input" if split else "B") + ("_first" if first else "")
                    before = "F"
                if (before, stage, mb) not in done:
                    raise ValueError(
                        f"Timetable {timetable.name!r} runs {what} before its {before}."
                    )
                entry[ACT] = need(act_of, (stage, mb), what, tick)
                entry[GRAD] = need(grad_of, (stage, mb), what, tick)
                if kind == "W" or not split:
                    act_slots[rank].free(int(entry[ACT]))
                    grad_slots[rank].free(int(entry[GRAD]))
                if kind == "B" and not first:
                    arrivals.append(("grad", rank, (stage - 1, mb)))
            if name not in names:
                names.append(name)
            entry[BRANCH] = names.index(name)
        for buffer, source, key in arrivals:
            rank = timetable.place_of(key[0])[0]
            slots, store = (act_slots, act_of) if buffer == "act" else (grad_slots, grad_of)
            col = _arrival_column(buffer, source, rank, p, timetable.name)
            slot = slots[rank].take()
            store[key] = (slot, tick)
            table[tick, rank, col] = slot
    kinds = ("F", "B", "W") if split else ("F", "B")
    missing = [
        f"{k}(microbatch={mb}, stage={s})"
        for k in kinds
        for s in range(num_model_stages)
        for mb in range(m)
        if (k, s, mb) not in done
    ]
    if missing:
        raise ValueError(
            f"Timetable {timetable.name!r} never runs {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}; every stage must run each microbatch."
        )
    return BufferPlan(
        table=table,
        branches=tuple(names),
        num_act_slots=max(1, max(s.peak for s in act_slots)),
        num_grad_slots=max(1, max(s.peak for s in grad_slots)),
    )
