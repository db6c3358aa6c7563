"""A timetable as each pipeline rank's ops: its actions in order, and its transfers.

The process executor (``jaxpg.pipeline.process.executor``) runs each pipeline rank in its own
process, as torch's and Paddle's pipelines do: the rank runs its own actions in the
timetable's order, each as soon as its inputs are there, and the activations and
gradients travel by point-to-point transfers between two processes. This module turns a
:class:`~jaxpg.pipeline.schedule.timetable.Timetable` into that form, in plain Python:

* :class:`RankOp`, one action of one rank with what it reads and where its output goes:
  the message it needs from another rank (``needs``), the message it makes for the next
  (``sends``, with the destination rank, or the rank itself at the turn of a V), and
  whether it is the first use of an accumulator (``init``: it writes the weight
  gradient instead of adding to zeros).
* :class:`Transfer`, one message between two ranks, and :func:`pair_transfers`, the
  order in which the two ranks of a pair move their messages.

Transfers between two XLA processes are collectives: both ends must enter each one,
in the same order. The order is the timetable's: by the tick that made the message,
then by the sender. It keeps both ranks' own orders: a rank never waits in a transfer
for a message that it will itself make only after an action that waits for that
transfer. So no rank can deadlock (each action and each transfer only waits for
actions and transfers of earlier ticks, or of the same tick earlier in this order), and
an in-order lane per pair costs no waiting that the actions do not already impose:
a transfer waits only for messages its receiver consumes later anyway, or that its
sender made earlier.

Example:
    >>> from jaxpg.pipeline.schedule.builders import get_schedule
    >>> tt = get_schedule("1f1b", 2, 2)
    >>> [op.label for op in rank_ops(tt, 1)]
    ['F0', 'B0', 'F1', 'B1']
    >>> [(t.src, t.dst, t.key) for t in pair_transfers(tt, 0, 1)][:2]
    [(0, 1, ('act', 1, 0)), (0, 1, ('act', 1, 1))]
"""

from __future__ import annotations

from typing import NamedTuple

from jaxpg.pipeline.schedule.timetable import Timetable

__all__ = ["MessageKey", "RankOp", "Transfer", "rank_ops", "pair_transfers", "peers_of"]

#: A message: ``("act", stage, microbatch)``, the input activation of ``stage``, or
#: ``("grad", stage, microbatch)``, the gradient of the output of ``stage``.
MessageKey = tuple[str, int, int]


class RankOp(NamedTuple):
    """One action of one rank in the process executor.

    Attributes:
        kind: ``"F"``, ``"B"`` or ``"W"`` (as in the timetable).
        microbatch: the microbatch.
        chunk: the chunk (model stage ``stage`` on this rank).
        stage: the model stage.
        tick: the timetable's tick (orders the transfers).
        first: whether ``stage`` is the first model stage (embeds the inputs).
        last: whether ``stage`` is the last model stage (runs the head and loss).
        needs: the message this action reads from the neighbour stage (on another rank,
            or on this one at the turn of a V layout), or ``None``.
        sends: ``(key, dst)``: the message it makes and the rank it goes to (this rank
            at the turn of a V layout), or ``None``.
        init: ``F`` on the last stage: the first to write the loss and head gradient; ``B``
            (whole backward) or ``W``: the first to write the chunk's weight gradient; ``B``
            on the first stage: the first to write the embedding's gradient.
    """

    kind: str
    microbatch: int
    chunk: int
    stage: int
    tick: int
    first: bool
    last: bool
    needs: MessageKey | None
    sends: tuple[MessageKey, int] | None
    init: bool

    @property
    def label(self) -> str:
        """``F3`` (or ``F3b`` for chunk 1), as the timetable prints it."""
        return f"{self.kind}{self.microbatch}" + (chr(ord("a") + self.chunk) if self.chunk else "")


class Transfer(NamedTuple):
    """One message from rank ``src`` to rank ``dst``, made at ``tick``."""

    tick: int
    src: int
    dst: int
    key: MessageKey


def _input_key(tt: Timetable, kind: str, stage: int, mb: int) -> MessageKey | None:
    """The message an action reads from a neighbour stage (None: it makes its own input)."""
    n = tt.num_model_stages
    if kind == "F":
        return None if stage == 0 else ("act", stage, mb)
    if kind == "B":
        return None if stage == n - 1 else ("grad", stage, mb)
    return None


def _output(tt: Timetable, kind: str, stage: int, mb: int) -> tuple[MessageKey, int] | None:
    n = tt.num_model_stages
    if kind == "F" and stage < n - 1:
        return ("act", stage + 1, mb), tt.place_of(stage + 1)[0]
    if kind == "B" and stage > 0:
        return ("grad", stage - 1, mb), tt.place_of(stage - 1)[0]
    return None


def rank_ops(tt: Timetable, rank: int) -> list[RankOp]:
    """Rank ``rank``'s actions in its timetable order, with their messages.

    Args:
        tt: the timetable.
        rank: the pipeline rank, ``0 .. p - 1``.

    Returns:
        One :class:`RankOp` per action of the rank, in tick order.
    """
    if not 0 <= rank < tt.num_stages:
        raise ValueError(f"rank={rank} must be in 0..{tt.num_stages - 1} for {tt.name!r}.")
    n = tt.num_model_stages
    seen: set[tuple[str, int]] = set()  # (accumulator, chunk) written once already
    ops = []
    for tick, action in tt.actions_of(rank):
        stage = tt.stage_of(rank, action.chunk)
        kind, mb = action.kind, action.microbatch
        needs = _input_key(tt, kind, stage, mb)
        if kind == "F" and stage == n - 1:
            acc = ("last", 0)
        elif kind == "W" or (kind == "B" and not tt.split_backward):
            acc = ("stage", action.chunk)
        elif kind == "B" and stage == 0:
            acc = ("first", 0)
        else:
            acc = None
        init = acc is not None and acc not in seen
        if acc is not None:
            seen.add(acc)
        ops.append(RankOp(kind, mb, action.chunk, stage, tick, stage == 0, stage == n - 1,
                          needs, _output(tt, kind, stage, mb), init))
    return ops


def pair_transfers(tt: Timetable, a: int, b: int) -> list[Transfer]:
    """Every message between ranks ``a`` and ``b`` (either way), in the order both move them.

    The order is by the tick that made the message, then by the sender's rank; see the
    module docstring for why this cannot deadlock.
    """
    if a == b:
        raise ValueError(f"pair_transfers needs two different ranks, got a=b={a}.")
    out = []
    for tick, row in enumerate(tt.grid):
        for src in sorted((a, b)):
            action = row[src]
            if action is None:
                continue
            sent = _output(tt, action.kind, tt.stage_of(src, action.chunk), action.microbatch)
            if sent is not None and sent[1] == (b if src == a else a):
                out.append(Transfer(tick, src, sent[1], sent[0]))
    return out


def peers_of(tt: Timetable, rank: int) -> list[int]:
    """The other ranks ``rank`` exchanges messages with, sorted."""
    peers = set()
    for _, action in tt.actions_of(rank):
        sent = _output(tt, action.kind, tt.stage_of(rank, action.chunk), action.microbatch)
        if sent is not None and sent[1] != rank:
            peers.add(sent[1])
    for other in range(tt.num_stages):
        if other != rank and any(t.dst == rank for t in pair_transfers(tt, rank, other)):
            peers.add(other)
    return sorted(peers)
