"""The timing loop every benchmark uses: variants in alternating rounds, medians, load.

A *round* calls every variant once, in an order that rotates from round to round
(:func:`rotated`), so that load from other work on a shared machine hits every variant
alike; a variant's sample in a round is ``iters`` back-to-back calls, each blocked on its
result, timed together and divided by ``iters``. What to report is the median over rounds
(:func:`medians`), and a ratio of two variants is best taken round by round
(:func:`ratio_median`). The 1-minute load average is read before the first round and after
every round (:class:`Rounds`), and goes into the result (:meth:`Rounds.record`).

Imports neither torch nor JAX: :func:`block` waits for ``jax.Array`` results only when JAX
is already imported. Across processes, pass the barrier of the processes' world
(``bench/_timing.py`` does so for torch's gloo world; ``jaxpg.barrier`` for jaxpg's).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


def rotated(keys: Sequence[str], r: int) -> list[str]:
    """``keys`` in round ``r``'s order: starting at ``keys[r % len(keys)]``, wrapping."""
    k = r % len(keys)
    return list(keys[k:]) + list(keys[:k])


def block(out: Any) -> None:
    """Waits for every ``jax.Array`` in ``out`` (any pytree; other leaves are ignored)."""
    jax = sys.modules.get("jax")
    if jax is None:  # nothing JAX can have made
        return
    for leaf in jax.tree.leaves(out):
        if isinstance(leaf, jax.Array):
            leaf.block_until_ready()


def no_wait(out: Any) -> None:
    """A ``wait`` for :func:`run_rounds` that does not wait (times the call's return)."""


def load_average() -> list[float]:
    """The 1, 5 and 15-minute load averages (``os.getloadavg``), rounded to 0.01."""
    return [round(x, 2) for x in os.getloadavg()]


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    """``{variant: median over its rounds}``."""
    return {v: statistics.median(t) for v, t in times.items()}


def ratio_median(a: Iterable[float], b: Iterable[float]) -> float:
    """The median over rounds of ``a[r] / b[r]`` (same-round samples of two variants)."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def diff_median(a: Iterable[float], b: Iterable[float]) -> float:
    """The median over rounds of ``a[r] - b[r]``."""
    return statistics.median(x - y for x, y in zip(a, b, strict=True))


@dataclass
class Rounds:
    """What :func:`run_rounds` measured.

    Attributes:
        wall: ``{variant: [seconds per call in round 0, round 1, ...]}`` (wall clock).
        cpu: the same in this process's CPU time (``time.process_time``, every thread): the
            work done, whatever other jobs do to the wall clock.
        load: the 1-minute load average before round 0, then after every round.
        load_before, load_after: :func:`load_average` before the first and after the last
            round.
    """

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]
    load: list[float] = field(default_factory=list)
    load_before: list[float] = field(default_factory=list)
    load_after: list[float] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return len(next(iter(self.wall.values()), []))

    def medians(self, cpu: bool = False) -> dict[str, float]:
        """``{variant: median seconds per call}`` (of the CPU times with ``cpu``)."""
        return medians(self.cpu if cpu else self.wall)

    def loads(self) -> dict[str, list[float]]:
        """The load averages, as results record them."""
        return {"load_average_before": self.load_before, "load_average_after": self.load_after}

    def record(self, scale: float = 1.0, unit: str = "s") -> dict[str, Any]:
        """A JSON-ready summary: rounds, the medians and every round's sample (times
        ``scale``, keys ending in ``unit``: ``record(1e3, "ms")``), and the load averages."""
        return {
            "rounds": self.rounds,
            f"median_{unit}": {v: t * scale for v, t in self.medians().items()},
            f"cpu_median_{unit}": {v: t * scale for v, t in self.medians(cpu=True).items()},
            f"round_{unit}": {v: [t * scale for t in ts] for v, ts in self.wall.items()},
            **self.loads(),
        }


def run_rounds(fns: dict[str, Callable[[], Any]], rounds: int, *, iters: int = 1,
               warmup: int = 0, barrier: Callable[[], Any] | None = None,
               after: Callable[[], Any] | None = None,
               setup: Callable[[str], Any] | None = None,
               wait: Callable[[Any], None] = block,
               settle: Callable[[Any], None] | None = None,
               cpu_clock: Callable[[], float] = time.process_time,
               budget_s: float | None = None, min_rounds: int = 1,
               progress: Callable[[int, Rounds], None] | None = None) -> Rounds:
    """Times every variant of ``fns`` (zero-argument callables) round by round.

    Args:
        fns: ``{variant: fn}``; a call's result is passed to ``wait`` inside the timing.
        rounds: how many rounds (the most, with ``budget_s``).
        iters: back-to-back calls per sample, each waited for.
        warmup: untimed calls of every variant first (after ``barrier``, if given).
        barrier: called before every sample, untimed (across processes: every rank starts
            the sample together).
        after: called after every sample, untimed (e.g. a second barrier, so that no rank
            starts the next variant while another still runs this one).
        setup: called with the variant's name before its sample, untimed.
        wait: what makes a call's time its whole time: :func:`block` (the default) waits
            for its ``jax.Array`` results. To time only until a call returns (dispatch), pass
            ``wait=no_wait, settle=block``.
        settle: called with the sample's last result after the timing, untimed.
        cpu_clock: the CPU clock of :attr:`Rounds.cpu` (``time.thread_time``: the calling
            thread's alone).
        budget_s: stop after this many seconds of rounds, once ``min_rounds`` are done.
        progress: called with ``(round index, results so far)`` after every round.

    Returns:
        :class:`Rounds`; the samples are seconds per call.
    """
    for fn in fns.values():
        for _ in range(warmup):
            if barrier is not None:
                barrier()
            wait(fn())
    out = Rounds({v: [] for v in fns}, {v: [] for v in fns}, [os.getloadavg()[0]],
                 load_average())
    start = time.perf_counter()
    for r in range(rounds):
        if budget_s is not None and r >= min_rounds and time.perf_counter() - start > budget_s:
            break
        for v in rotated(list(fns), r):
            fn = fns[v]
            if setup is not None:
                setup(v)
            if barrier is not None:
                barrier()
            c0 = cpu_clock()
            t0 = time.perf_counter()  # the wall clock inside the CPU clock's reads
            for _ in range(iters):
                last = fn()
                wait(last)
            t1 = time.perf_counter()
            c1 = cpu_clock()
            out.wall[v].append((t1 - t0) / iters)
            out.cpu[v].append((c1 - c0) / iters)
            if settle is not None:
                settle(last)
            if after is not None:
                after()
        out.load.append(os.getloadavg()[0])
        if progress is not None:
            progress(r, out)
    out.load_after = load_average()
    return out


def time_rounds(fns: dict[str, Callable[[], Any]], rounds: int, iters: int = 1,
                **kwargs: Any) -> dict[str, list[float]]:
    """:func:`run_rounds`' wall-clock samples alone: ``{variant: [seconds per call]}``."""
    return run_rounds(fns, rounds, iters=iters, **kwargs).wall
