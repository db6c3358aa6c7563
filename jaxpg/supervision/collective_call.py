"""One collective call of a multi-process world: numbered, recorded, and never a silent hang.

Every eager collective and every recorded jitted step (``jaxpg.supervision.recorded_step``)
goes through :func:`run_collective`. The call takes the group's next sequence number, notes it
as this process's progress (``jaxpg.supervision.progress``, published in the background),
starts a flight-recorder record (``jaxpg.supervision.flight_recorder``) and runs by the
world's semantics (``jaxpg.supervision.watchdog``): blocking on the runner thread
(``jaxpg.supervision.runner``) for at most the group's timeout, or stream-ordered under the
watchdog. Time the dispatching thread spends tracing and compiling does not count
(``jaxpg.supervision.compile_clock``). When the result does not come,
``jaxpg.supervision.hang_diagnosis`` asks the peers what they run and the
``DistTimeoutError`` names the ranks at fault; a failure inside XLA's collectives (gloo's
``Connection closed by peer``) becomes a ``DistNetworkError`` that names them the same way.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import re
import threading
import time
from typing import Any

import jax

from jaxpg.errors import DistNetworkError, DistTimeoutError
from jaxpg.supervision import compile_clock, hang_diagnosis, liveness, signature_check, watchdog
from jaxpg.supervision.flight_recorder import capture_caller, recorder
from jaxpg.supervision.hang_report import Call as _Call
from jaxpg.supervision.hang_report import Reporter as _HangReporter
from jaxpg.supervision.progress import progress as _progress
from jaxpg.supervision.runner import Job
from jaxpg.supervision.runner import runner as _runner

__all__ = ["configure", "group_store", "run_collective", "submit", "wait_job", "timeout_text",
           "recorded_region"]

_detail = False  # JAXPG_DEBUG=DETAIL, read at init_process_group
_signatures = True  # the default desync check (off under JAXPG_DEBUG=OFF), read there too
_heartbeat = 10.0  # JAXPG_HEARTBEAT_TIMEOUT, read at init_process_group
_LIVENESS_SLICE = 0.1  # how often a waiting caller looks for lost peers (seconds)
_MAX_EXTENSIONS = 20  # timeouts in a row that a peer still compiling may extend
_in_place = False  # backend="mpi": every collective runs on MPI's thread, now
_check: Any = None  # backend="mpi": checks a call before it runs (group, api) -> None


def configure(detail: bool, heartbeat: float, in_place: bool = False,
              check: Any = None) -> None:
    """Sets the world's DETAIL mode and heartbeat timeout (``init_process_group``); with
    ``backend="mpi"``, ``in_place`` runs every collective on the caller's thread and
    ``check(group, api)`` vets each call first. The default signature check
    (``jaxpg.supervision.signature_check``) is on unless ``JAXPG_DEBUG=OFF``."""
    global _detail, _heartbeat, _in_place, _check, _signatures
    _detail, _heartbeat, _in_place, _check = detail, heartbeat, in_place, check
    _signatures = signature_check.check_enabled() and not detail


def submit(fn: Any, api: str) -> Job:
    """Queues ``fn`` (a whole eager collective) on the runner thread and returns its Job at
    once: ``async_op=True`` in a multi-process run. Collectives ``fn`` calls run in place
    on the runner, in call order with every other queued collective.

    With ``backend="mpi"`` the collective runs here, now (XLA's MPI collectives serve one
    thread), and the Job comes back finished."""
    if not _in_place:
        return _runner.submit(fn, api, capture_caller() if recorder.enabled else None)
    job = Job(api)
    try:
        result = fn()
    except BaseException as err:  # noqa: BLE001 (handed to the Job, raised by wait)
        job._finish(None, err)
    else:
        job._finish(result, None)
    return job


def wait_job(job: Job, timeout: float | None) -> Any:
    """The job's result; after ``timeout`` seconds (not counting the runner's compile time),
    the named ``DistTimeoutError`` (and the runner, stuck in that collective, is abandoned:
    the group is broken, as in torch). Meanwhile it prints what the call waits for every
    ``JAXPG_HANG_REPORT_SECONDS`` (``jaxpg.supervision.hang_report``)."""
    thread = job.thread
    base = compile_clock.seconds(thread) if thread is not None else 0.0
    start = time.monotonic()
    extended = 0
    report = _HangReporter(thread, timeout)  # a line every JAXPG_HANG_REPORT_SECONDS
    while True:
        try:
            return job.result(_LIVENESS_SLICE)
        except concurrent.futures.TimeoutError:
            pass
        report.poll(job if job.group is not None else _runner.current)
        if liveness.lost():  # a peer this collective needs is gone: name it now
            stuck = job if job.group is not None else _runner.current
            if stuck is not None and stuck.group is not None:
                try:
                    _check_alive(stuck.group, stuck.api, stuck.seq)
                except DistNetworkError:
                    if not job.finished:
                        _runner.abandon()
                    raise
        if timeout is None or (thread is not None and compile_clock.compiling(thread)):
            continue
        compiled = compile_clock.seconds(thread) - base if thread is not None else 0.0
        if time.monotonic() - start - compiled < timeout:
            continue
        stuck = job if job.group is not None else (_runner.current or job)
        if stuck.group is None:
            if not job.finished:
                _runner.abandon()
            raise DistTimeoutError(f"{job.api}: did not start within {timeout:.1f} s.")
        diagnosis = hang_diagnosis.diagnose(stuck.group, stuck.api, stuck.seq, timeout)
        if job.finished:
            continue  # it finished while the peers were asked: no hang after all
        if diagnosis.extend and extended < _MAX_EXTENSIONS:
            extended += 1  # a peer still compiles this call: give it another timeout
            start, base = time.monotonic(), compile_clock.seconds(thread) if thread else 0.0
            continue
        _runner.abandon()
        _mark(stuck.group, stuck.seq, "timed out", diagnosis.text)
        raise DistTimeoutError(diagnosis.text)


def timeout_text(group: Any, api: str, seq: int, seconds: float) -> str:
    """The ``DistTimeoutError`` text of call ``api`` #``seq`` on ``group``."""
    return hang_diagnosis.diagnose(group, api, seq, seconds).text


def _mark(group: Any, seq: int, state: str, text: str) -> None:
    record = recorder.last.get(group.group_name)
    if record is not None and record.seq == seq:
        record.fail(state, text)


def _check_alive(group: Any, api: str, seq: int) -> None:
    """Raises ``DistNetworkError`` naming the group's lost ranks, if it has any."""
    state = group._world
    liveness.check(hang_diagnosis.processes_of(state, group.members),
                   lambda procs: hang_diagnosis.ranks_of_processes(state, procs, group.members),
                   f"{api} #{seq} on group {group.group_name!r}")


def group_store(group: Any) -> Any:
    """The group's PrefixStore (made on first use for groups made without a barrier)."""
    if group.store is None:
        from jaxpg.stores import PrefixStore

        group.store = PrefixStore(group.group_name, group._world.store)
    return group.store


def run_collective(group: Any, api: str, fn: Any, fingerprint: Any = None,
                   kind: str = "collective") -> Any:
    """Runs ``fn`` (a kernel's or a jitted step's dispatch) as the group's next collective.

    The call's sequence number and fingerprint are noted as this process's progress and in
    the flight recorder; the processes first compare the call's signature
    (``jaxpg.supervision.signature_check``; under ``JAXPG_DEBUG=DETAIL``, the fingerprints
    through the store: ``jaxpg.supervision.desync``), and a mismatch raises
    ``DistDesyncError`` on every rank before anything runs. Then, by the world's semantics:

    * blocking (gloo): ``fn`` runs on the runner thread and the caller waits until its
      outputs are ready for at most the group's timeout (compile time excluded); then the
      ``DistTimeoutError`` names the ranks at fault (``jaxpg.supervision.hang_diagnosis``), and
      a failure in XLA's collectives becomes ``DistNetworkError`` naming them;
    * stream-ordered (NCCL, TPU): ``fn`` is dispatched here and its result returned at once;
      the watchdog ends the process if it is not done within the group's timeout.

    Inside a job on the runner thread (an ``async_op=True`` collective) it runs in place.

    Args:
        group: the ProcessGroup.
        api: the collective's or step's name.
        fn: dispatches the work and returns its (possibly unfinished) outputs.
        fingerprint: ``(api, static arguments, ((name, per-rank shape, dtype), ...))``.
        kind: ``"collective"`` or ``"step"`` (a step's non-XLA errors, raised while tracing
            the user's code, pass through unchanged).
    """
    if group.store is None:
        group_store(group)
    if _check is not None:
        _check(group, api)
    blocking = group._world.blocking_wait
    if liveness.lost():
        _check_alive(group, api, group.seq + 1)
    if _runner.on_runner():
        job = _runner.running_job()
        caller = job.caller if job is not None else None
        return _run_here(group, api, fn, fingerprint, blocking, kind, caller)
    caller = capture_caller() if recorder.enabled else None

    def here(blocking: bool) -> Any:
        return _run_here(group, api, fn, fingerprint, blocking, kind, caller)

    if blocking:
        if not has_peers(group) and _runner.idle():
            return here(True)  # nothing here can hang
        return wait_job(_runner.submit(lambda: here(True), api, caller),
                        group.timeout.total_seconds())
    if not _runner.idle():  # async jobs queued: keep the call order, wait for the dispatch
        return wait_job(_runner.submit(lambda: here(False), api, caller), None)
    return here(False)


def has_peers(group: Any) -> bool:
    """Whether another process holds ranks of ``group`` (else nothing can hang: a world of
    one process runs its collectives in place, without the runner's thread hop)."""
    peers = group.__dict__.get("_jaxpg_has_peers")
    if peers is None:
        state = group._world
        peers = group.__dict__["_jaxpg_has_peers"] = \
            hang_diagnosis.processes_of(state, group.members) != [state.process_index]
    return peers


@contextlib.contextmanager
def recorded_region(group: Any, api: str, fingerprint: Any = None,
                    kind: str = "region") -> Any:
    """A stretch of host code that runs its own collectives and waits (a pipeline schedule's
    step: its lanes' transfers, each with its timeout and its named errors) as one numbered,
    recorded call on ``group``: it takes the group's next sequence number, notes it as this
    process's progress, and starts a flight-recorder record, completed when the region
    ends and failed with the error that ends it otherwise. Every rank of ``group`` must
    enter its regions in the same order, as with any collective.

    Yields:
        The region's sequence number on ``group``.
    """
    seq = group.next_seq()
    if has_peers(group):
        _progress.note(group, seq, fingerprint)
    record = recorder.start(group, seq, api, kind, fingerprint,
                            capture_caller() if recorder.enabled else None)
    rid = record.id
    try:
        yield seq
    except BaseException as err:
        record.fail("failed", f"{type(err).__name__}: {err}", rid)
        raise
    record.complete(rid)


def _run_here(group: Any, api: str, fn: Any, fingerprint: Any, blocking: bool, kind: str,
              caller: Any) -> Any:
    """Numbers, notes, records, (checks,) dispatches and, when ``blocking``, waits for one
    collective."""
    seq = group.next_seq()
    job = _runner.running_job()
    if job is not None:
        job.group, job.api, job.seq = group, api, seq
    if has_peers(group):  # alone, no one needs to know how far this process got
        _progress.note(group, seq, fingerprint)
    record = recorder.start(group, seq, api, kind, fingerprint, caller)
    if _detail:
        try:
            _compare(group, api, seq, fingerprint)
        except Exception as err:
            record.fail("failed", str(err))
            raise
    entry = None
    if not blocking:
        seconds = group.timeout.total_seconds()
        reporter = _HangReporter(threading.get_ident(), seconds)
        entry = watchdog.watch(
            time.monotonic() + seconds, lambda: _watchdog_text(group, api, seq, seconds),
            thread=threading.get_ident(), record=record,
            failure=lambda err: _failure_text(group, api, seq, err),
            report=lambda: reporter.poll(_Call(group, api, seq)))
    if _signatures and has_peers(group):
        _check_signature(group, api, seq, fingerprint, record, entry)
    try:
        out = fn()
        if blocking:
            for x in jax.tree.leaves(out):
                if isinstance(x, jax.Array):
                    x.block_until_ready()
            record.complete()
            return out
    except Exception as err:  # XLA's collectives report a lost peer as a runtime error
        if entry is not None:
            entry.failed = True
        if kind == "step" and not _collective_failure(err, group):
            record.fail("failed", f"{type(err).__name__}: {err}")
            raise  # the user's code failed while tracing: not a collective's failure
        text = _failure_text(group, api, seq, err)
        record.fail("failed", text)
        raise DistNetworkError(text) from err
    leaves = jax.tree.leaves(out)
    if leaves and isinstance(leaves[0], jax.Array):
        entry.array = leaves[0]
    else:
        entry.failed = True  # nothing on the device to watch
        record.complete()
    return out


def _check_signature(group: Any, api: str, seq: int, fingerprint: Any, record: Any,
                     entry: Any) -> None:
    """Runs the signature check before the call; its failure in XLA is a
    ``DistNetworkError``, a mismatch a ``DistDesyncError`` (the record fails with either)."""
    try:
        mismatch = signature_check.mismatched(signature_check.dispatch(group, fingerprint))
    except Exception as err:  # a peer lost during the check's gather
        if entry is not None:
            entry.failed = True
        text = _failure_text(group, api, seq, err)
        record.fail("failed", text)
        raise DistNetworkError(text) from err
    if mismatch:
        if entry is not None:
            entry.failed = True
        try:
            signature_check.raise_mismatch(group, api, seq, fingerprint)
        except Exception as err:
            record.fail("failed", str(err))
            raise


_COLLECTIVE_WORDS = re.compile(r"(?i)gloo|nccl|mpi|collective|all-?reduce|all-?gather|"
                               r"reduce-?scatter|all-?to-?all|permute|connection|peer|socket|"
                               r"unavailable|aborted|deadline")


_XLA_STATUS = re.compile(r"^(UNKNOWN|INTERNAL|UNAVAILABLE|ABORTED|DEADLINE_EXCEEDED|CANCELLED|"
                         r"FAILED_PRECONDITION|DATA_LOSS): ")


def _collective_failure(err: Exception, group: Any) -> bool:
    """Whether a step's error is XLA's collectives failing (else it is the user's code, or
    e.g. memory running out, and passes through as it is). XLA reports it as a
    ``JaxRuntimeError``, or, from a program's execution, as a ``ValueError`` or
    ``RuntimeError`` whose text starts with its status (``UNKNOWN: Gloo all-reduce
    failed``)."""
    if not isinstance(err, jax.errors.JaxRuntimeError) and not (
            isinstance(err, (ValueError, RuntimeError)) and _XLA_STATUS.match(str(err))):
        return False
    if liveness.lost():
        return True
    return bool(_COLLECTIVE_WORDS.search(str(err)))


def _watchdog_text(group: Any, api: str, seq: int, seconds: float) -> tuple[str, bool]:
    diagnosis = hang_diagnosis.diagnose(group, api, seq, seconds)
    return diagnosis.text, diagnosis.extend


def _failure_text(group: Any, api: str, seq: int, err: Any) -> str:
    """The ``DistNetworkError`` text of a call that failed in XLA: the diagnosis, and the
    ranks the coordination service lost (it notices a dead peer within the heartbeat)."""
    state = group._world
    lost = liveness.wait_lost(hang_diagnosis.processes_of(state, group.members),
                              _heartbeat + 1.0)
    first = str(err).strip().splitlines()[0][:400] if str(err).strip() else repr(err)
    diagnosis = hang_diagnosis.diagnose(group, api, seq, 0.0, failure=first)
    text = diagnosis.text
    if lost:
        liveness.mark_reported()
        ranks = hang_diagnosis.ranks_of_processes(state, lost, group.members)
        text += (f" Lost ranks {ranks} (processes {lost}): the coordination service stopped "
                 "hearing from them.")
    elif not diagnosis.at_fault:
        text += (" If every rank is alive, or a peer aborted in gloo with 'Received data size "
                 "doesn't match', the ranks may have called different collectives or shapes: "
                 "rerun with JAXPG_DEBUG=DETAIL.")
    return text


def _compare(group: Any, api: str, seq: int, fingerprint: Any) -> None:
    from jaxpg.supervision import desync

    state = group._world
    procs = hang_diagnosis.processes_of(state, group.members)
    rank_of = {p: hang_diagnosis.ranks_of_processes(state, [p], group.members)[0]
               for p in procs}
    desync.compare_fingerprints(
        group.store, seq, state.process_index,
        desync.fingerprint_text(group.group_name, seq, fingerprint), procs, rank_of,
        group.timeout, api, group.group_name)
    if seq > 2:
        _progress.discard(group, f"detail/{seq - 2}/{state.process_index}")
