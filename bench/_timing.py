"""The torch side of the workers that time jaxpg beside torch.distributed in one process.

``bench/_collectives_mp_worker.py``, ``bench/_throughput_ddp_worker.py``,
``bench/_pipeline_mp_worker.py`` and the other torch workers (each started by ``jaxpg.run``,
one process per rank) join jaxpg's world and a torch gloo world of the same ranks, time
their variants with ``bench/_rounds.py``'s loop, a torch barrier before each sample, and
keep the slowest rank's time of every round. Imports torch; the workers import this module
where they import torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _rounds import Rounds, run_rounds

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


def time_rounds(fns: dict[str, Callable[[], Any]], rounds: int, iters: int = 1,
                **kwargs: Any) -> Rounds:
    """``bench/_rounds.run_rounds`` with a torch barrier before every sample: this rank's
    seconds per call of every variant, one sample a round (``kwargs``: run_rounds')."""
    return run_rounds(fns, rounds, iters=iters, barrier=dist.barrier, **kwargs)


def slowest_rank(times: Rounds | dict[str, list[float]]) -> dict[str, list[float]]:
    """Every rank's :func:`time_rounds` samples gathered (a collective: every rank calls
    it); returns, for each variant and round, the slowest rank's time."""
    mine = times.wall if isinstance(times, Rounds) else times
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {v: [max(t[v][r] for t in everyone) for r in range(len(mine[v]))] for v in mine}
