"""Shared pieces of the workers that time jaxpg beside torch.distributed in one process.

``bench/_collectives_mp_worker.py``, ``bench/_throughput_ddp_worker.py`` and
``bench/_pipeline_mp_worker.py`` (each started by ``jaxpg.run``, one process per rank)
join jaxpg's world and a torch gloo world of the same ranks, time their variants round by
round in a rotating order with a torch barrier before each, and keep the slowest rank's
time of every round. Imports torch; the workers import this module where they import
torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import torch
import torch.distributed as dist

import jaxpg


def join_both_worlds(torch_port: int, torch_threads: int = 1) -> tuple[int, int]:
    """Joins jaxpg's world (from the launcher's environment) and torch's, same ranks.

    Args:
        torch_port: the port of torch's ``tcp://127.0.0.1`` rendezvous (rank 0 listens).
        torch_threads: ``torch.set_num_threads`` for this process.

    Returns:
        ``(rank, world_size)``.
    """
    jaxpg.init_process_group()
    rank, n = jaxpg.get_rank(), jaxpg.get_world_size()
    torch.set_num_threads(torch_threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}",
                            rank=rank, world_size=n)  # fmt: skip
    return rank, n


def leave_both_worlds() -> None:
    """Waits for every rank (torch barrier), then leaves torch's world and jaxpg's."""
    dist.barrier()
    dist.destroy_process_group()
    jaxpg.destroy_process_group()


def rotated(keys: Sequence[str], r: int) -> list[str]:
    """``keys`` in round ``r``'s order: starting at ``keys[r % len(keys)]``, wrapping."""
    k = r % len(keys)
    return list(keys[k:]) + list(keys[:k])


def block(out: Any) -> None:
    """Waits for every ``jax.Array`` in ``out`` (any pytree; other leaves are ignored)."""
    for leaf in jax.tree.leaves(out):
        if isinstance(leaf, jax.Array):
            leaf.block_until_ready()


def time_rounds(fns: dict[str, Callable[[], Any]], rounds: int,
                iters: int = 1) -> dict[str, list[float]]:
    """This rank's seconds per call of every variant, one sample a round.

    In each round every variant runs once, in the order :func:`rotated` gives; a variant's
    sample is a torch barrier, then ``iters`` back-to-back calls, each blocked on its
    result, timed together and divided by ``iters``.

    Returns:
        ``{variant: [seconds per call in round 0, round 1, ...]}``.
    """
    times: dict[str, list[float]] = {v: [] for v in fns}
    for r in range(rounds):
        for v in rotated(list(fns), r):
            f = fns[v]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                block(f())  # every call blocks, as torch's do (jaxpg's block anyway)
            times[v].append((time.perf_counter() - t0) / iters)
    return times


def slowest_rank(times: dict[str, list[float]], rounds: int) -> dict[str, list[float]]:
    """Every rank's :func:`time_rounds` result gathered (a collective: every rank calls
    it); returns, for each variant and round, the slowest rank's time."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, times)
    return {v: [max(t[v][r] for t in everyone) for r in range(rounds)] for v in times}
