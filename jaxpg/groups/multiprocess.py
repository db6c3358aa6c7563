"""The multi-process world: rendezvous, store-based barriers, and timeouts instead of hangs.

``init_process_group`` comes here when a launcher environment, ``init_method`` or ``store``
says the job spans processes. After the rendezvous (``jaxpg.rendezvous``) JAX's
coordination service runs; its key/value store is the world's Store, and XLA's own
collectives (gloo or MPI on CPU, NCCL on GPU) move every tensor byte.

Every eager collective and recorded jitted step runs through
``jaxpg.supervision.collective_call`` (re-exported here: ``run_collective``, ``submit``,
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

from jaxpg.errors import DistError, DistNetworkError, DistTimeoutError
from jaxpg.supervision import collective_call, compile_clock, fr_requests, liveness, watchdog
from jaxpg.supervision.collective_call import (  # noqa: F401 (the call API, re-exported)
    group_store,
    run_collective,
    submit,
    timeout_text,
    wait_job,
)
from jaxpg.supervision.desync import detail_enabled
from jaxpg.supervision.flight_recorder import buffer_size_from_env, recorder
from jaxpg.supervision.hang_diagnosis import processes_of as _processes_of
from jaxpg.supervision.hang_diagnosis import ranks_of_processes as _ranks_of_processes
from jaxpg.supervision.progress import progress as _progress

__all__ = ["init_world", "shutdown_world", "on_groups_created", "run_collective", "submit",
           "wait_job", "timeout_text", "monitored_barrier"]

_mpi_families: set = set()  # families whose MPI communicators exist (backend="mpi")


def init_world(backend: str | None, init_method: str | None, timeout: datetime.timedelta,
               world_size: int, rank: int, store: Any, state_cls: type) -> Any:
    """Rendezvous, start ``jax.distributed`` and build the world's state."""
    from jaxpg.groups.backend import Backend, names_mpi, resolve_backend
    from jaxpg.rendezvous import initialize_jax_distributed, mpi_collectives, rendezvous
    from jaxpg.stores import PrefixStore

    fr_size = buffer_size_from_env()  # a bad value fails before anything starts
    if backend is not None and ":" not in str(backend):
        Backend(backend)  # reject unknown names before anything starts
    mpi = names_mpi(backend)
    if mpi:  # before anything starts: the library, async dispatch off, MPI's client factory
        mpi_collectives.prepare()
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
    in_place = chosen == Backend.MPI
    if in_place:
        mpi_collectives.check_started(jax.process_index(), jax.process_count(),
                                      len(local_ranks))
        mpi_collectives.warm_up(devices)  # the world's communicator, made on MPI's thread
        _mpi_families.clear()
        _mpi_families.add(state.world_group.family)
    # MPI: dispatched on the caller's thread (synchronous: async dispatch is off); a stuck
    # collective cannot be abandoned, so the watchdog ends the process at the timeout
    state.blocking_wait = watchdog.blocking_wait(devices[0].platform) and not in_place
    state.process_index = jax.process_index()
    state.process_count = jax.process_count()
    state.world_group.store = PrefixStore("WORLD", world_store)
    collective_call.configure(detail_enabled(), heartbeat, in_place=in_place,
                              check=_check_mpi if in_place else None)
    recorder.configure(fr_size)
    compile_clock.install()
    from jaxpg.runtime import coordination_service

    client = coordination_service.global_client()
    if client is not None:
        liveness.start(client, state.process_count, state.process_index,
                       abort_on_lost_zero=coordination_service.service_host == "rank0-child",
                       grace_s=timeout.total_seconds(),
                       ranks_of=lambda procs: _ranks_of_processes(state, procs,
                                                                  range(len(devices))))
        fr_requests.start(state, client)
    _store_barrier(state, state.world_group.store, "init", list(range(state.process_count)),
                   timeout, "init_process_group")
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
                     timeout: datetime.timedelta, what: str = "",
                     state: Any = None) -> list[int]:
    """Checks in under ``prefix/<me>`` and waits for every process's key; returns the
    processes still missing when ``timeout`` ran out (empty when all arrived). A lost process
    raises ``DistNetworkError`` naming ``what`` (the call) and, given ``state``, its ranks."""
    store.add(f"{prefix}/{me}", 1)
    keys = {p: f"{prefix}/{p}" for p in procs}
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check(list(keys.values())):
        gone = [p for p in liveness.lost() if p in keys]
        if gone:
            who = f"processes {gone}" if state is None else (
                f"ranks {_ranks_of_processes(state, gone, range(len(state.devices)))} "
                f"(processes {gone})")
            raise DistNetworkError(f"{what + ' ' if what else ''}(store barrier {prefix!r}): "
                                   f"lost {who}: the coordination service stopped hearing "
                                   "from them (they died, exited or hang).")
        if time.monotonic() > deadline:
            return [p for p in procs if not store.check([keys[p]])]
        time.sleep(0.005)
    return []


def _store_barrier(state: Any, store: Any, name: str, procs: list[int],
                   timeout: datetime.timedelta, api: str = "") -> None:
    """The seed's ``_store_based_barrier``: every process checks in, then waits for all;
    raises ``DistTimeoutError`` naming the ranks that did not arrive and how many did."""
    missing = _arrive_and_wait(store, f"barrier/{name}", state.process_index, procs, timeout,
                               api, state)
    if missing:
        ranks = _ranks_of_processes(state, missing, range(len(state.devices)))
        raise DistTimeoutError(
            f"{api or 'store barrier'} (store barrier {name!r}): {len(procs) - len(missing)} "
            f"of {len(procs)} processes arrived within {timeout.total_seconds():.1f} s; ranks "
            f"that did not arrive: {ranks} (processes {missing}). Every process must call it, "
            "in the same order."
        )


def check_in(group: Any, api: str, timeout: datetime.timedelta | None = None) -> None:
    """Every process of ``group`` checks in for its next ``api`` call (``barrier``,
    ``save_checkpoint``) and waits for the others' check-in of the same call, so that the
    call only ever meets the same call: raises ``DistTimeoutError`` on every process that
    called it, naming the ranks that did not, after the group's timeout."""
    state = group._world
    counts = group.__dict__.setdefault("_check_ins", {})
    counts[api] = n = counts.get(api, 0) + 1
    timeout = timeout or group.timeout
    procs = _processes_of(state, group.members)
    missing = _arrive_and_wait(group_store(group), f"calls/{api}/{n}", state.process_index,
                               procs, timeout, f"{api} #{n} on group {group.group_name!r}",
                               state)
    if missing:
        ranks = _ranks_of_processes(state, missing, group.members)
        raise DistTimeoutError(
            f"{api} #{n} on group {group.group_name!r}: ranks {ranks} did not call {api} "
            f"within {timeout.total_seconds():.1f} s. Every rank of the group must call it, "
            "in the same order (a call made on some ranks only, such as `if rank == 0:`, "
            f"waits for the others forever).{_last_call_mismatch(group, timeout)}"
        )


def _last_call_mismatch(group: Any, timeout: datetime.timedelta) -> str:
    """After a failed check-in: the ranks' last collectives on the group, when the flight
    records show them called with different shapes or arguments (else "")."""
    last = recorder.last.get(group.group_name)
    if last is None or last.seq != group.seq:
        return ""
    from jaxpg.supervision import hang_diagnosis

    text = hang_diagnosis.diagnose(group, last.op, last.seq, timeout.total_seconds()).text
    return f" Before it: {text}" if "different shapes or arguments" in text else ""


def on_groups_created(state: Any, groups: Sequence[Any], members_only: bool = False) -> None:
    """Gives each new group its PrefixStore and runs the creation barrier over the world
    (over the group's own processes with ``members_only``)."""
    from jaxpg.stores import PrefixStore

    for g in groups:
        group_store(g)
    first = groups[0]
    procs = _processes_of(state, first.members) if members_only else \
        list(range(state.process_count))
    _store_barrier(state, PrefixStore(first.group_name, state.store), "created",
                   procs, first.timeout,
                   f"new_group {first.group_name!r}")


def monitored_barrier(group: Any, timeout: datetime.timedelta, wait_all_ranks: bool) -> None:
    """A store barrier over the group's processes that names the ranks that did not arrive."""
    state = group._world
    group._monitored = getattr(group, "_monitored", 0) + 1
    procs = _processes_of(state, group.members)
    missing = _arrive_and_wait(group_store(group), f"monitored/{group._monitored}",
                               state.process_index, procs, timeout,
                               f"monitored_barrier on group {group.group_name!r}", state)
    if missing:
        ranks = _ranks_of_processes(state, missing, group.members)
        shown = ranks if wait_all_ranks else ranks[:1]
        raise DistTimeoutError(
            f"monitored_barrier on group {group.group_name!r}: ranks {shown} did not "
            f"arrive within {timeout.total_seconds():.1f} s."
        )


def _check_mpi(group: Any, api: str) -> None:
    """backend="mpi": the call comes from MPI's thread, on a group XLA's MPI can serve, and
    a family's first collective waits until every process reached it (its communicator is
    made with ``MPI_Comm_split`` over all processes: a missing one is named, not a hang)."""
    import threading
    import zlib

    from jaxpg.groups.backend import mpi_unsupported
    from jaxpg.rendezvous import mpi_collectives

    if threading.get_ident() != mpi_collectives.main_thread():
        raise DistError(
            f"{api}: with backend='mpi', collectives must be called from the thread that "
            "called init_process_group (XLA's MPI collectives serve only the thread that "
            f"started MPI); this is thread {threading.current_thread().name!r}."
        )
    if group.__dict__.get("_jaxpg_mpi_ready"):
        return
    error = mpi_unsupported(group, api)
    if error is not None:
        raise error
    if group.family in _mpi_families or not collective_call.has_peers(group):
        group.__dict__["_jaxpg_mpi_ready"] = True
        return
    state = group._world
    name = f"mpi_communicator/{zlib.crc32(repr(group.family).encode()):08x}"
    missing = _arrive_and_wait(state.world_group.store, name, state.process_index,
                               list(range(state.process_count)), group.timeout,
                               f"{api} #{group.seq + 1} on group {group.group_name!r}", state)
    if missing:
        raise DistTimeoutError(
            f"{api} #{group.seq + 1} on group {group.group_name!r}: with "
            "backend='mpi', the first collective of a family of subgroups needs every "
            "process (XLA makes its communicator with MPI_Comm_split over all processes), "
            f"and ranks {_ranks_of_processes(state, missing, range(len(state.devices)))} did "
            f"not reach it within {group.timeout.total_seconds():.1f} s; every process must "
            "call the collective on its own subgroup, in the same order."
        )
    _mpi_families.add(group.family)
    group.__dict__["_jaxpg_mpi_ready"] = True
