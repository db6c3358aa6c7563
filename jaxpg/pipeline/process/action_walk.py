"""One rank's step in the process executors: its actions in timetable order, beside its
lanes' transfers.

Both process executors, ``jaxpg.pipeline.process.executor`` (stacked, identical stages) and
``jaxpg.pipeline.process.stage_runner`` (one ``PipelineStage`` each), run a step the same way: one
lane job per neighbour moves the step's messages (``p2p_lanes``) while the host walks the
rank's actions (``rank_ops``), taking each action's input from the mail right before
it is read and posting its output as soon as it is made. What differs is what an action
computes, which each executor says through the small :class:`RankActions` protocol.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import Any, Protocol

from jaxpg.errors import DistTimeoutError
from jaxpg.pipeline.process.p2p_lanes import StepMail

__all__ = ["RankActions", "walk_actions", "run_beside_lanes", "wait_lane"]


class RankActions(Protocol):
    """What one rank's actions compute; each method returns the value the action sends
    (``op.sends``), or anything when it sends nothing.

    ``op`` is a ``rank_ops`` action: ``kind`` (``"F"``, ``"B"`` or ``"W"``), ``stage``,
    ``microbatch``, ``chunk``, ``first``/``last`` (whether its stage is the model's first or
    last), ``needs`` (the message it reads) and ``sends``.
    """

    def forward(self, op: Any, x: Any) -> Any:
        """``F``; ``x`` is the received activation, None on the first stage."""

    def backward(self, op: Any, dy: Any) -> Any:
        """``B``; ``dy`` is the received gradient, None on the last stage."""

    def weight(self, op: Any) -> Any:
        """``W`` of a split backward."""

    def done(self, op: Any, out: Any) -> None:
        """Called after the action's output was posted (a step timeline records it)."""


def walk_actions(plan: Any, actions: RankActions, mail: StepMail,
                 on_wait: Callable[[tuple, float, float], None] | None = None) -> None:
    """Runs ``plan.ops`` through ``actions``, receiving and posting their messages.

    Args:
        plan: the rank's plan: ``ops``, ``me``, ``pairs`` (peer -> (lane, transfers)) and
            ``global_of`` (pipeline rank -> global rank).
        actions: what the actions compute.
        mail: the step's mail.
        on_wait: ``on_wait(key, start, end)`` after each receive (a step timeline).
    """
    src_of = {}  # message key -> the global rank it comes from
    for _, transfers in plan.pairs.values():
        src_of.update((t.key, t.src) for t in transfers if t.dst == plan.me)

    def get(key: tuple) -> Any:
        start = time.perf_counter()
        value = mail.receive(key, src_of.get(key, plan.me))
        if on_wait is not None:
            on_wait(key, start, time.perf_counter())
        return value

    for op in plan.ops:
        if op.kind == "F":
            out = actions.forward(op, None if op.first else get(op.needs))
        elif op.kind == "B":
            out = actions.backward(op, None if op.last else get(op.needs))
        else:
            out = actions.weight(op)
        if op.sends is not None:
            key, dst = op.sends
            mail.post(key, plan.global_of[dst], out)
        actions.done(op, out)


def run_beside_lanes(plan: Any, mail: StepMail, lane_step: Callable[[Any, Any], None],
                     walk: Callable[[], Any]) -> Any:
    """Starts ``lane_step(lane, transfers)`` on each neighbour's lane, runs ``walk()`` and
    waits for the lanes; on any error cancels the mail and abandons the lanes still busy
    (stuck in a transfer with a lost peer) before raising it. Returns ``walk()``'s result."""
    jobs = []
    for q, (lane, transfers) in plan.pairs.items():
        jobs.append((q, lane, lane.runner.submit(
            lambda lane=lane, transfers=transfers: lane_step(lane, transfers), mail.what)))
    try:
        result = walk()
        for q, _, job in jobs:
            wait_lane(job, mail, plan.global_of[q])
    except BaseException:
        mail.cancel()
        for _, lane, job in jobs:
            if not job.finished:
                lane.runner.abandon()
        raise
    return result


def wait_lane(job: Any, mail: StepMail, peer: int) -> None:
    """Waits for a lane's transfers of this step to end, naming the peer on a timeout."""
    deadline = time.monotonic() + mail.timeout
    while True:
        try:
            return job.result(0.1)
        except concurrent.futures.TimeoutError:
            pass
        if mail.error is not None:
            raise mail.error
        mail.check_peers([peer], f"sending to rank {peer}")
        if time.monotonic() > deadline:
            raise DistTimeoutError(
                f"{mail.what}: rank {mail.me} waited {mail.timeout:.1f} s for rank {peer} to "
                f"take its last messages; ranks that did not arrive: [{peer}]."
            )
