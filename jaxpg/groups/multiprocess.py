"""The multi-process world: rendezvous, store-based barriers, and timeouts instead of hangs.

``init_process_group`` comes here when a launcher environment, ``init_method`` or ``store``
says the job spans processes. After the rendezvous (``jaxpg.rendezvous``) JAX's
coordination service runs; its key/value store is the world's Store, and XLA's own
collectives (gloo or MPI on CPU, NCCL on GPU) move every tensor byte.

Every eager collective notes its sequence number as this process's progress in the group
(``<group>/progress/<process>``, a counter that always equals the highest sequence number
this process reached), then waits for its result for at most the group's timeout. A
background thread writes the progress counters, at most one key/value RPC per group every
20 ms however many collectives run, so a small collective pays no round trip to the
coordination service. If the result does not come, the counters tell which processes never
reached that collective, and the DistTimeoutError names their ranks.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax

from jaxpg.errors import DistNetworkError, DistTimeoutError

__all__ = ["init_world", "shutdown_world", "on_groups_created", "run_collective",
           "monitored_barrier"]



class _Runner:
    """One daemon thread that runs eager kernels, so the caller can stop waiting.

    On CPU, XLA runs a collective on the dispatching thread when it counts it cheap (under
    1000 flops: a small all_reduce; all_gather, all_to_all and ppermute, which have no
    flops, at any size), so a peer that never arrives would block the caller forever.
    Kernels run here instead; the caller waits with a timeout. A thread left stuck in a
    dead collective is abandoned (it is a daemon, so it does not keep the process alive)
    and a fresh one serves later calls.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def _loop(self, jobs: queue.SimpleQueue) -> None:
        while True:
            fn, fut = jobs.get()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 (handed to the caller)
                    fut.set_exception(exc)

    def submit(self, fn: Any) -> concurrent.futures.Future:
        if self._thread is None:
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._loop, args=(self._jobs,),
                                            name="jaxpg-collective", daemon=True)
            self._thread.start()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, fut))
        return fut

    def abandon(self) -> None:
        self._thread = None


_runner = _Runner()


class _Progress:
    """Publishes each group's highest sequence number this process reached, in the background.

    ``note`` only records the number and wakes the thread. The thread raises the group's
    counter ``progress/<process>`` (``add`` of the difference: one RPC, no lock) and then
    rests ``_PERIOD`` seconds, so a loop of many small collectives costs a few RPCs a second
    instead of one each. A process stuck in a collective has published its number long
    before a peer's timeout reads it; ``publish_now`` writes this process's at once.
    """

    _PERIOD = 0.02

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: dict[Any, list[int]] = {}  # group -> [reached, published]
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def note(self, group: Any, seq: int) -> None:
        with self._lock:
            entry = self._latest.setdefault(group, [0, 0])
            entry[0] = max(entry[0], seq)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="jaxpg-progress",
                                                daemon=True)
                self._thread.start()
        self._wake.set()

    def publish_now(self, group: Any | None = None) -> None:
        with self._lock:
            todo = [(g, e[0] - e[1]) for g, e in self._latest.items()
                    if e[0] > e[1] and (group is None or g is group)]
            for g, delta in todo:
                self._latest[g][1] += delta
        for g, delta in todo:
            try:
                g.store.add(f"progress/{g._world.process_index}", delta)
            except Exception:  # noqa: BLE001 (a lost store shows in the collective itself)
                pass

    def forget(self) -> None:
        with self._lock:
            self._latest.clear()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            self.publish_now()
            time.sleep(self._PERIOD)


_progress = _Progress()


def init_world(backend: str | None, init_method: str | None, timeout: datetime.timedelta,
               world_size: int, rank: int, store: Any, state_cls: type) -> Any:
    """Rendezvous, start ``jax.distributed`` and build the world's state."""
    from jaxpg.groups.backend import Backend, resolve_backend
    from jaxpg.rendezvous import initialize_jax_distributed, rendezvous
    from jaxpg.stores import PrefixStore

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
    state.process_index = jax.process_index()
    state.process_count = jax.process_count()
    state.world_group.store = PrefixStore("WORLD", world_store)
    _store_barrier(state, state.world_group.store, "init", list(range(state.process_count)),
                   timeout)
    return state


def shutdown_world(state: Any) -> None:
    """Closes the store, stops ``jax.distributed`` and clears JAX's backends.

    A new ``init_process_group`` may follow; arrays made in the old world are invalid.
    """
    from jaxpg.rendezvous import shutdown_jax_distributed

    _progress.forget()
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


def _group_store(group: Any) -> Any:
    """The group's PrefixStore (made on first use for groups made without a barrier)."""
    if group.store is None:
        from jaxpg.stores import PrefixStore

        group.store = PrefixStore(group.group_name, group._world.store)
    return group.store


def run_collective(group: Any, api: str, fn: Any) -> Any:
    """Runs ``fn`` (dispatch and wait) as the group's next collective, for at most the
    group's timeout.

    The collective's sequence number is noted as this process's progress (published in the
    background, see ``_Progress``); on timeout, the progress counters name the ranks that
    never reached it.
    """
    _group_store(group)
    seq = group.next_seq()
    _progress.note(group, seq)

    def call() -> Any:
        out = fn()
        for x in jax.tree.leaves(out):
            if isinstance(x, jax.Array):
                x.block_until_ready()
        return out

    fut = _runner.submit(call)
    seconds = group.timeout.total_seconds()
    try:
        return fut.result(timeout=seconds)
    except concurrent.futures.TimeoutError:
        _runner.abandon()
        ranks = _missing_ranks(group, seq, grace=0.25)
        raise DistTimeoutError(
            f"{api} on group {group.group_name!r} (sequence number {seq}) did not finish "
            f"within {seconds:.1f} s; ranks that did not arrive: {ranks}"
            + ("" if ranks else " (all arrived: a peer may have died during the collective)")
            + "."
        ) from None
    except Exception as err:  # XLA's collectives report a lost peer as a runtime error
        ranks = _missing_ranks(group, seq, grace=1.0)
        raise DistNetworkError(
            f"{api} on group {group.group_name!r} (sequence number {seq}) failed: {err}; "
            f"ranks that did not arrive: {ranks}."
        ) from err


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
