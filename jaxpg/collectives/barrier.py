"""barrier and monitored_barrier."""

from __future__ import annotations

import datetime
from typing import Any

import numpy as np

from jaxpg.collectives._dispatch import resolve
from jaxpg.collectives.eager import local_count, run_eager
from jaxpg.collectives.work import Work, returns_work_at_once

__all__ = ["barrier", "monitored_barrier"]


@returns_work_at_once
def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> Any:
    """Blocks until every rank of the group has reached it.

    In multi-process runs every rank first checks in through the coordination service for
    this group's barrier number ``n``, so a barrier only ever completes against the other
    ranks' barrier ``n`` (never another collective, such as a library's own sync), and a
    rank that never arrives gives a DistTimeoutError naming it after the group's timeout.
    """
    del device_ids
    api = "barrier"
    pg, ctx = resolve(group, api)
    if ctx is not None:
        raise ValueError(f"{api}: SPMD code runs in lockstep and needs no barrier; call it "
                         "from host code.")
    n_local = local_count(pg, api)
    before = None
    if pg._world.multiprocess:
        from jaxpg.groups import multiprocess

        def before() -> None:  # meets only barrier() #n of this group
            multiprocess.check_in(pg, api)
    token = np.zeros((n_local, 1) if n_local > 1 else (1,), np.int32)
    out = run_eager(pg, api, None, lambda lay, x: lay.gather(x).sum(0), {"x": token}, before)
    work = Work(out, api)
    if async_op:
        return work
    work.wait()
    return None


def monitored_barrier(group: Any = None, timeout: datetime.timedelta | None = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier that raises DistTimeoutError naming the ranks that did not arrive.

    With ``wait_all_ranks`` the error lists every missing rank, else the first. In one
    process every rank is local and arrives at once.
    """
    pg, _ = resolve(group, "monitored_barrier")
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"monitored_barrier: timeout must be a datetime.timedelta; got "
                        f"{timeout!r}.")
    state = pg._world
    if state.multiprocess:
        from jaxpg.groups import multiprocess

        multiprocess.monitored_barrier(pg, timeout or pg.timeout, wait_all_ranks)
        return
    local_count(pg, "monitored_barrier")
