"""The multi-process world: rendezvous, store-based barriers, and timeouts instead of hangs.

``init_process_group`` comes here when a launcher environment, ``init_method`` or ``store``
says the job spans processes. After the rendezvous (``jaxpg.rendezvous``) JAX's
coordination service runs; its key/value store is the world's Store, and XLA's own
collectives (gloo or MPI on CPU, NCCL on GPU) move every tensor byte.

Every eager collective notes its sequence number and fingerprint as this process's progress
in the group (``jaxpg.groups.progress``: published in the background, so a small collective
pays no round trip to the coordination service), then runs by the world's semantics
(``jaxpg.groups.watchdog``): blocking on the runner thread (``jaxpg.groups.runner``) for at
most the group's timeout, or stream-ordered under the watchdog. If the result does not come,
the progress counters tell which processes never reached that collective, and the
DistTimeoutError names their ranks (or, when all arrived, what each is running).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import os
import time
from collections.abc import Sequence
from typing import Any

import jax

from jaxpg.errors import DistError, DistNetworkError, DistTimeoutError
from jaxpg.groups import liveness, watchdog
from jaxpg.groups.desync import detail_enabled
from jaxpg.groups.progress import progress as _progress
from jaxpg.groups.runner import Job
from jaxpg.groups.runner import runner as _runner

__all__ = ["init_world", "shutdown_world", "on_groups_created", "run_collective", "submit",
           "wait_job", "monitored_barrier"]

_detail = False  # JAXPG_DEBUG=DETAIL, read at init_world
_in_place = False  # backend="mpi": every collective runs on MPI's thread (see init_world)
_mpi_families: set = set()  # families whose MPI communicators exist (backend="mpi")
_heartbeat = 10.0  # JAXPG_HEARTBEAT_TIMEOUT, read at init_world
_LIVENESS_SLICE = 0.1  # how often a waiting caller looks for lost peers (seconds)


def submit(fn: Any, api: str) -> Job:
    """Queues ``fn`` (a whole eager collective) on the runner thread and returns its Job at
    once: ``async_op=True`` in a multi-process run. Collectives ``fn`` calls run in place
    on the runner, in call order with every other queued collective.

    With ``backend="mpi"`` the collective runs here, now (XLA's MPI collectives serve one
    thread), and the Job comes back finished."""
    if not _in_place:
        return _runner.submit(fn, api)
    job = Job(api)
    try:
        result = fn()
    except BaseException as err:  # noqa: BLE001 (handed to the Job, raised by wait)
        job._finish(None, err)
    else:
        job._finish(result, None)
    return job


def wait_job(job: Job, timeout: float | None) -> Any:
    """The job's result; after ``timeout`` seconds, the named ``DistTimeoutError`` (and the
    runner, stuck in that collective, is abandoned: the group is broken, as in torch)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            return job.result(_LIVENESS_SLICE if left is None else min(left, _LIVENESS_SLICE))
        except concurrent.futures.TimeoutError:
            pass
        if liveness.lost():  # a peer this collective needs is gone: name it now
            stuck = job if job.group is not None else _runner.current
            if stuck is not None and stuck.group is not None:
                try:
                    _check_alive(stuck.group, stuck.api, stuck.seq)
                except DistNetworkError:
                    if not job.finished:
                        _runner.abandon()
                    raise
        if left is not None and left <= 0:
            break
    stuck = job if job.group is not None else (_runner.current or job)
    if not job.finished:
        _runner.abandon()
    if stuck.group is None:
        raise DistTimeoutError(f"{job.api}: did not start within {timeout:.1f} s.")
    raise DistTimeoutError(_timeout_text(stuck.group, stuck.api, stuck.seq, timeout))


def _check_alive(group: Any, api: str, seq: int) -> None:
    """Raises ``DistNetworkError`` naming the group's lost ranks, if it has any."""
    state = group._world
    liveness.check(_processes_of(state, group.members),
                   lambda procs: _ranks_of_processes(state, procs, group.members),
                   f"{api} on group {group.group_name!r} (sequence number {seq})")




def init_world(backend: str | None, init_method: str | None, timeout: datetime.timedelta,
               world_size: int, rank: int, store: Any, state_cls: type) -> Any:
    """Rendezvous, start ``jax.distributed`` and build the world's state."""
    from jaxpg.groups.backend import Backend, names_mpi, resolve_backend
    from jaxpg.rendezvous import initialize_jax_distributed, mpi_collectives, rendezvous
    from jaxpg.stores import PrefixStore

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
    global _detail, _in_place
    _detail = detail_enabled()
    _in_place = chosen == Backend.MPI
    if _in_place:
        mpi_collectives.check_started(jax.process_index(), jax.process_count(),
                                      len(local_ranks))
        mpi_collectives.warm_up(devices)  # the world's communicator, made on MPI's thread
        _mpi_families.clear()
        _mpi_families.add(state.world_group.family)
    # MPI: dispatched on the caller's thread (synchronous: async dispatch is off); a stuck
    # collective cannot be abandoned, so the watchdog ends the process at the timeout
    state.blocking_wait = watchdog.blocking_wait(devices[0].platform) and not _in_place
    state.process_index = jax.process_index()
    state.process_count = jax.process_count()
    state.world_group.store = PrefixStore("WORLD", world_store)
    global _heartbeat
    _heartbeat = heartbeat
    from jaxpg.stores import coordination

    client = coordination.global_client()
    if client is not None:
        liveness.start(client, state.process_count, state.process_index,
                       abort_on_lost_zero=coordination.service_host == "rank0-child",
                       grace_s=timeout.total_seconds(),
                       ranks_of=lambda procs: _ranks_of_processes(state, procs,
                                                                  range(len(devices))))
    _store_barrier(state, state.world_group.store, "init", list(range(state.process_count)),
                   timeout, "init_process_group")
    return state


def shutdown_world(state: Any) -> None:
    """Closes the store, stops ``jax.distributed`` and clears JAX's backends.

    A new ``init_process_group`` may follow; arrays made in the old world are invalid.
    """
    from jaxpg.rendezvous import shutdown_jax_distributed

    liveness.stop(leaving=True)  # the others leave now: that is no loss
    _progress.forget()
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


def _processes_of(state: Any, ranks: Sequence[int]) -> list[int]:
    return sorted({state.devices[r].process_index for r in ranks})


def _ranks_of_processes(state: Any, procs: Sequence[int], ranks: Sequence[int]) -> list[int]:
    return [r for r in ranks if state.devices[r].process_index in set(procs)]


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
                   timeout: datetime.timedelta, api: str = "") -> None:
    """The seed's ``_store_based_barrier``: every process checks in, then waits for all;
    raises ``DistTimeoutError`` naming the ranks that did not arrive and how many did."""
    missing = _arrive_and_wait(store, f"barrier/{name}", state.process_index, procs, timeout)
    if missing:
        ranks = _ranks_of_processes(state, missing, range(len(state.devices)))
        raise DistTimeoutError(
            f"{api or 'store barrier'} (store barrier {name!r}): {len(procs) - len(missing)} "
            f"of {len(procs)} processes arrived within {timeout.total_seconds():.1f} s; ranks "
            f"that did not arrive: {ranks} (processes {missing}). Every process must call it, "
            "in the same order."
        )


def on_groups_created(state: Any, groups: Sequence[Any]) -> None:
    """Gives each new group its PrefixStore and runs the creation barrier over the world."""
    from jaxpg.stores import PrefixStore

    for g in groups:
        _group_store(g)
    first = groups[0]
    _store_barrier(state, PrefixStore(first.group_name, state.store), "created",
                   list(range(state.process_count)), first.timeout,
                   f"new_group {first.group_name!r}")


def _group_store(group: Any) -> Any:
    """The group's PrefixStore (made on first use for groups made without a barrier)."""
    if group.store is None:
        from jaxpg.stores import PrefixStore

        group.store = PrefixStore(group.group_name, group._world.store)
    return group.store


def run_collective(group: Any, api: str, fn: Any, fingerprint: Any = None) -> Any:
    """Runs ``fn`` (the kernel's dispatch) as the group's next collective.

    The collective's sequence number and fingerprint are noted as this process's progress
    (published in the background, see ``_Progress``); under ``JAXPG_DEBUG=DETAIL`` the
    processes first compare fingerprints (``jaxpg.groups.desync``). Then, by the world's
    semantics (``jaxpg.groups.watchdog``):

    * blocking (gloo): ``fn`` runs on the runner thread and the caller waits for its result
      for at most the group's timeout; on timeout the progress counters name the ranks that
      never reached it (``DistTimeoutError``), and a failure in XLA's collectives becomes
      ``DistNetworkError`` with the same facts;
    * stream-ordered (NCCL, TPU): ``fn`` is dispatched here and its result returned at once;
      the watchdog ends the process if it is not done within the group's timeout.

    Inside a job on the runner thread (an ``async_op=True`` collective) it runs in place.

    Args:
        group: the ProcessGroup.
        api: the collective's name.
        fn: dispatches the kernel and returns its (possibly unfinished) outputs.
        fingerprint: ``(api, static arguments, ((name, per-rank shape, dtype), ...))``.
    """
    if group.store is None:
        _group_store(group)
    state = group._world
    if _in_place:
        _check_mpi(group, api)
    blocking = state.blocking_wait
    if liveness.lost():
        _check_alive(group, api, group.seq + 1)
    if _runner.on_runner():
        return _run_here(group, api, fn, fingerprint, blocking)
    if blocking:
        if not _has_peers(group) and _runner.idle():
            return _run_here(group, api, fn, fingerprint, True)  # nothing here can hang
        job = _runner.submit(lambda: _run_here(group, api, fn, fingerprint, True), api)
        return wait_job(job, group.timeout.total_seconds())
    if not _runner.idle():  # async jobs queued: keep the call order, wait for the dispatch
        job = _runner.submit(lambda: _run_here(group, api, fn, fingerprint, False), api)
        return wait_job(job, None)
    return _run_here(group, api, fn, fingerprint, False)


def _check_mpi(group: Any, api: str) -> None:
    """backend="mpi": the call comes from MPI's thread, on a group XLA's MPI can serve, and
    a family's first collective waits until every process reached it (its communicator is
    made with ``MPI_Comm_split`` over all processes: a missing one is named, not a hang)."""
    import threading

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
    if group.family in _mpi_families or not _has_peers(group):
        group.__dict__["_jaxpg_mpi_ready"] = True
        return
    import zlib

    state = group._world
    name = f"mpi_communicator/{zlib.crc32(repr(group.family).encode()):08x}"
    missing = _arrive_and_wait(state.world_group.store, name, state.process_index,
                               list(range(state.process_count)), group.timeout)
    if missing:
        raise DistTimeoutError(
            f"{api} on group {group.group_name!r} (sequence number {group.seq + 1}): with "
            "backend='mpi', the first collective of a family of subgroups needs every "
            "process (XLA makes its communicator with MPI_Comm_split over all processes), "
            f"and ranks {_ranks_of_processes(state, missing, range(len(state.devices)))} did "
            f"not reach it within {group.timeout.total_seconds():.1f} s; every process must "
            "call the collective on its own subgroup, in the same order."
        )
    _mpi_families.add(group.family)
    group.__dict__["_jaxpg_mpi_ready"] = True


def _has_peers(group: Any) -> bool:
    """Whether another process holds ranks of ``group`` (else nothing can hang: a world of
    one process runs its collectives in place, without the runner's thread hop)."""
    peers = group.__dict__.get("_jaxpg_has_peers")
    if peers is None:
        state = group._world
        peers = group.__dict__["_jaxpg_has_peers"] = \
            _processes_of(state, group.members) != [state.process_index]
    return peers


def _run_here(group: Any, api: str, fn: Any, fingerprint: Any, blocking: bool) -> Any:
    """Numbers, notes, (checks,) dispatches and, when ``blocking``, waits for one collective."""
    seq = group.next_seq()
    job = _runner.running_job()
    if job is not None:
        job.group, job.api, job.seq = group, api, seq
    if _has_peers(group):  # alone, no one needs to know how far this process got
        _progress.note(group, seq, fingerprint)
    if _detail:
        _compare(group, api, seq, fingerprint)
    entry = None
    if not blocking:
        seconds = group.timeout.total_seconds()
        entry = watchdog.watch(time.monotonic() + seconds,
                               lambda: _timeout_text(group, api, seq, seconds))
    try:
        out = fn()
        if blocking:
            for x in jax.tree.leaves(out):
                if isinstance(x, jax.Array):
                    x.block_until_ready()
            return out
    except Exception as err:  # XLA's collectives report a lost peer as a runtime error
        if entry is not None:
            entry.failed = True
        state = group._world
        lost = liveness.wait_lost(_processes_of(state, group.members), _heartbeat + 1.0)
        if lost:
            liveness.mark_reported()
            raise DistNetworkError(
                f"{api} on group {group.group_name!r} (sequence number {seq}) failed: {err}; "
                f"lost ranks {_ranks_of_processes(state, lost, group.members)} (processes "
                f"{lost}): the coordination service stopped hearing from them."
            ) from err
        ranks = _missing_ranks(group, seq, grace=1.0)
        hint = "" if ranks else (
            " (all arrived: a peer died during the collective; if every rank is alive, or a "
            "peer aborted in gloo with 'Received data size doesn't match', the ranks may have "
            "called different collectives or shapes: rerun with JAXPG_DEBUG=DETAIL)")
        raise DistNetworkError(
            f"{api} on group {group.group_name!r} (sequence number {seq}) failed: {err}; "
            f"ranks that did not arrive: {ranks}{hint}."
        ) from err
    leaves = jax.tree.leaves(out)
    if leaves and isinstance(leaves[0], jax.Array):
        entry.array = leaves[0]
    else:
        entry.failed = True  # nothing on the device to watch
    return out


def _compare(group: Any, api: str, seq: int, fingerprint: Any) -> None:
    from jaxpg.groups import desync

    state = group._world
    procs = _processes_of(state, group.members)
    rank_of = {p: _ranks_of_processes(state, [p], group.members)[0] for p in procs}
    desync.compare_fingerprints(
        group.store, seq, state.process_index,
        desync.fingerprint_text(group.group_name, seq, fingerprint), procs, rank_of,
        group.timeout, api, group.group_name)
    if seq > 2:
        _progress.discard(group, f"detail/{seq - 2}/{state.process_index}")


def _timeout_text(group: Any, api: str, seq: int, seconds: float) -> str:
    """The DistTimeoutError text: the op, group, sequence number and the missing ranks; when
    every rank arrived, what each is running (from the progress records)."""
    ranks = _missing_ranks(group, seq, grace=0.25)
    text = (f"{api} on group {group.group_name!r} (sequence number {seq}) did not finish "
            f"within {seconds:.1f} s; ranks that did not arrive: {ranks}")
    if ranks:
        return text + "."
    if not _has_peers(group):
        return text + (" (this process holds every rank of the group: the collective, or device "
                       "work queued ahead of it, is still running).")
    running = _running(group)
    from jaxpg.groups.desync import describe_mismatch

    mismatch = describe_mismatch(running) if running else None
    if mismatch:
        return (text + f" (all arrived, but they run different collectives: {mismatch} "
                "Run with JAXPG_DEBUG=DETAIL to catch this before the collective runs.)")
    shown = "; ".join(f"rank {r}: {t}" for r, t in sorted(running.items()))
    return (text + " (all arrived: a peer may have died during the collective, or device work "
            "queued ahead of it is still running"
            + (f"; each rank is running {shown}" if shown else "") + ").")


def _running(group: Any) -> dict[int, str]:
    """What each process of the group last published as running (rank -> fingerprint)."""
    state = group._world
    out = {}
    for p in _processes_of(state, group.members):
        key = f"running/{p}"
        try:
            if group.store.check([key]):
                out[_ranks_of_processes(state, [p], group.members)[0]] = \
                    group.store.get(key).decode()
        except Exception:  # noqa: BLE001 (a dead store: say nothing more)
            pass
    return out


def _missing_ranks(group: Any, seq: int, grace: float) -> list[int]:
    """The ranks whose processes' progress in ``group`` is below ``seq``.

    Progress is published in the background (every ``_Progress._PERIOD`` s), so this
    writes this process's own at once and gives peers' counters ``grace`` seconds to
    catch up (a failure can come before their last write).
    """
    state = group._world
    _progress.publish_now(group)
    procs = [p for p in _processes_of(state, group.members) if p != state.process_index]
    deadline = time.monotonic() + grace

    def reached(p: int) -> int:
        key = f"progress/{p}"
        return int(group.store.get(key)) if group.store.check([key]) else 0

    while True:
        missing = [p for p in procs if reached(p) < seq]
        if not missing or time.monotonic() >= deadline:
            return _ranks_of_processes(state, missing, group.members)
        time.sleep(0.02)


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
