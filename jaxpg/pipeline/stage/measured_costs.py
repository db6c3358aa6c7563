"""One stage's ``F``, ``B`` and ``W`` timed on this machine, as :class:`ActionCosts`.

The weights the schedule tools (:mod:`jaxpg.pipeline.schedule.costs`) replay a timetable
with, measured instead of the papers' unit costs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax

from jaxpg.pipeline.schedule.costs import ActionCosts
from jaxpg.pipeline.stage.split import split_stage

__all__ = ["measure_costs"]


def measure_costs(
    stage_fn: Callable[[Any, Any], Any],
    params: Any,
    x: Any,
    *,
    split_backward: bool,
    repeats: int = 20,
) -> ActionCosts:
    """Times one stage's ``F``, ``B`` (and ``W``) as the executor runs them, ``F = 1``.

    Uses the no-remat pieces (:func:`jaxpg.pipeline.stage.split.split_stage`): ``F``
    saves residuals, ``B`` is the input gradient when ``split_backward`` (else the whole
    backward), ``W`` the weight gradient. Each is jitted and timed on the default device.

    Args:
      stage_fn: ``stage_fn(params, x) -> y``.
      params: one stage's parameters (arrays).
      x: one microbatch's activation (arrays).
      split_backward: whether ``B`` and ``W`` are split.
      repeats: timed runs per piece; the median is used.
    """
    pieces = split_stage(stage_fn, params, x, split_backward)
    forward = jax.jit(pieces.forward)
    backward = jax.jit(pieces.backward)
    y, res = forward(params, x)
    dy = jax.tree.map(lambda a: a * 0 + 1, y)
    _, _, wres = backward(params, x, dy, res)
    calls = {"F": lambda: forward(params, x), "B": lambda: backward(params, x, dy, res)}
    if split_backward:
        weight = jax.jit(pieces.weight)
        calls["W"] = lambda: weight(params, x, dy, res, wres)
    seconds = {}
    for kind, call in calls.items():
        jax.block_until_ready(call())
        samples = []
        for _ in range(repeats):
            begin = time.perf_counter()
            jax.block_until_ready(call())
            samples.append(time.perf_counter() - begin)
        seconds[kind] = statistics.median(samples)
    unit = seconds["F"]
    return ActionCosts(1.0, seconds["B"] / unit, seconds.get("W", 0.0) / unit)
