"""The multi-process world: rendezvous, store-based barriers, and timeouts instead of hangs.

``init_process_group`` comes here when a launcher environment, ``init_method`` or ``store``
says the job spans processes. After the rendezvous (``jaxpg.rendezvous``) JAX's
coordination service runs; its key/value store is the world's Store, and XLA's own
collectives (gloo or MPI on CPU, NCCL on GPU) move every tensor byte.

Every eager collective and recorded jitted step runs through
``jaxpg.groups.collective_call`` (re-exported here: ``run_collective``, ``submit``,
``wait_job``): numbered on its group, noted as this process's progress, recorded by the
flight recorder, and run by the world's semantics, so that a call whose peers never come
raises a ``DistTimeoutError`` naming them instead of hanging.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Sequence
from typing import Any

import jax

from jaxpg.errors import DistNetworkError, DistTimeoutError
from jaxpg.groups import collective_call, compile_clock, fr_requests, liveness, watchdog
from jaxpg.groups.collective_call import (  # noqa: F401 (the call API, re-exported)
    _group_store,
    run_collective,
    submit,
    timeout_text,
    wait_job,
)
from jaxpg.groups.desync import detail_enabled
from jaxpg.groups.flight_recorder import buffer_size_from_env, recorder
from jaxpg.groups.hang_diagnosis import processes_of as _processes_of
from jaxpg.groups.hang_diagnosis import ranks_of_processes as _ranks_of_processes
from jaxpg.groups.progress import progress as _progress

__all__ = ["init_world", "shutdown_world", "on_groups_created", "run_collective", "submit",
           "wait_job", "timeout_text", "monitored_barrier"]


def init_world(backend: str | None, init_method: str | None, timeout: datetime.timedelta,
               world_size: int, rank: int, store: Any, state_cls: type) -> Any:
    """Rendezvous, start ``jax.distributed`` and build the world's state."""
    from jaxpg.groups.backend import Backend, resolve_backend
    from jaxpg.rendezvous import initialize_jax_distributed, rendezvous
    from jaxpg.stores import PrefixStore

    fr_size = buffer_size_from_env()  # a bad value fails before anything starts
    if backend is not None and ":" not in str(backend):
        Backend(backend)  # reject unknown names before anything starts
    if backend is not None and str(backend).lower() == "mpi":
        jax.config.update("jax_cpu_collectives_implementation", "mpi")
    info = rendezvous(init_method, rank=None if rank < 0 else rank,
                      world_size=None if world_size < 0 else world_size, store=store,
                      timeout=timeout.total_seconds())
    heartbeat = float(os.environ.get("JAXPG_HEARTBEAT_TIMEOUT", "10"))
    world_store = initialize_jax_distributed(info, timeout.total_seconds(),
                                             heartbeat_timeout=heartbeat)
    chosen = resolve_backend(backend)
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    local_ids = {d.id for d in jax.local_devices()}
    local_ranks = [i for i, d in enumerate(devices) if d.id in local_ids]
    state = state_cls(backend=chosen, devices=devices, local_ranks=local_ranks,
                      timeout=timeout, store=world_store, multiprocess=True)
    state.blocking_wait = watchdog.blocking_wait(devices[0].platform)
    state.process_index = jax.process_index()
    state.process_count = jax.process_count()
    state.world_group.store = PrefixStore("WORLD", world_store)
    collective_call.configure(detail_enabled(), heartbeat)
    recorder.configure(fr_size)
    compile_clock.install()
    from jaxpg.stores import coordination

    client = coordination.global_client()
    if client is not None:
        liveness.start(client, state.process_count, state.process_index,
                       abort_on_lost_zero=coordination.service_host == "rank0-child",
                       grace_s=timeout.total_seconds(),
                       ranks_of=lambda procs: _ranks_of_processes(state, procs,
                                                                  range(len(devices))))
        fr_requests.start(state, client)
    _store_barrier(state, state.world_group.store, "init", list(range(state.process_count)),
                   timeout)
    return state


def shutdown_world(state: Any) -> None:
    """Closes the store, stops ``jax.distributed`` and clears JAX's backends.

    A new ``init_process_group`` may follow; arrays made in the old world are invalid.
    """
    from jaxpg.rendezvous import shutdown_jax_distributed

    liveness.stop(leaving=True)  # the others leave now: that is no loss
    fr_requests.stop()
    _progress.forget()
    recorder.forget()
    watchdog.forget()
    try:
        if state.store is not None:
            state.store.close()
    finally:
        shutdown_jax_distributed()
        # The backends hold the old world's devices; a later init_process_group builds
        # new ones. Arrays of the old world are invalid from here on.
        from jax.extend.backend import clear_backends

        clear_backends()


def _arrive_and_wait(store: Any, prefix: str, me: int, procs: list[int],
                     timeout: datetime.timedelta) -> list[int]:
    """Checks in under ``prefix/<me>`` and waits for every process's key; returns the
    processes still missing when ``timeout`` ran out (empty when all arrived)."""
    store.add(f"{prefix}/{me}", 1)
    keys = {p: f"{prefix}/{p}" for p in procs}
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check(list(keys.values())):
        gone = [p for p in liveness.lost() if p in keys]
        if gone:
            raise DistNetworkError(f"store barrier {prefix!r}: lost processes {gone}: the "
                                   "coordination service stopped hearing from them.")
        if time.monotonic() > deadline:
            return [p for p in procs if not store.check([keys[p]])]
        time.sleep(0.005)
    return []


def _store_barrier(state: Any, store: Any, name: str, procs: list[int],
                   timeout: datetime.timedelta) -> None:
    """The seed's ``_store_based_barrier``: every process checks in, then waits for all."""
    missing = _arrive_and_wait(store, f"barrier/{name}", state.process_index, procs, timeout)
    if missing:
        raise DistTimeoutError(
            f"store barrier {name!r}: processes {missing} did not arrive within "
            f"{timeout.total_seconds():.1f} s."
        )


def on_groups_created(state: Any, groups: Sequence[Any]) -> None:
    """Gives each new group its PrefixStore and runs the creation barrier over the world."""
    from jaxpg.stores import PrefixStore

    for g in groups:
        _group_store(g)
    first = groups[0]
    _store_barrier(state, PrefixStore(first.group_name, state.store), "created",
                   list(range(state.process_count)), first.timeout)


def monitored_barrier(group: Any, timeout: datetime.timedelta, wait_all_ranks: bool) -> None:
    """A store barrier over the group's processes that names the ranks that did not arrive."""
    state = group._world
    group._monitored = getattr(group, "_monitored", 0) + 1
    procs = _processes_of(state, group.members)
    missing = _arrive_and_wait(_group_store(group), f"monitored/{group._monitored}",
                               state.process_index, procs, timeout)
    if missing:
        ranks = _ranks_of_processes(state, missing, group.members)
        shown = ranks if wait_all_ranks else ranks[:1]
        raise DistTimeoutError(
            f"monitored_barrier on group {group.group_name!r}: ranks {shown} did not "
            f"arrive within {timeout.total_seconds():.1f} s."
        )
