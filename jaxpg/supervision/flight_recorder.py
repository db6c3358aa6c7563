"""The flight recorder: this process's last N collective calls, over all its groups.

Every call that takes a sequence number on a group of a multi-process world (an eager
collective, a point-to-point transfer, a recorded jitted step) makes one ``CallRecord``:
group, sequence number, op or step name, inputs' shapes and dtypes, static arguments
(reduce op, src/dst), the collectives inside a step's compiled program, state, times, and
the caller's file and line. The last record of each group is always kept: it is what this
process tells a peer that diagnoses a hang (``jaxpg.supervision.fr_requests``). The ring buffer of
the last N records is kept when ``JAXPG_FR_BUFFER_SIZE=N`` (or torch's
``TORCH_FR_BUFFER_SIZE`` / ``TORCH_NCCL_TRACE_BUFFER_SIZE``) is above 0, read at
``init_process_group``; only then is the caller's frame looked up, since nothing but a
dump shows it (docs/debugging.md has its cost).

A record is created and updated without locks: a ``deque(maxlen=N)`` append and a few
attribute writes (the GIL makes each atomic); text is made only when a dump is written.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from typing import Any

__all__ = ["CallRecord", "recorder", "buffer_size_from_env", "capture_caller", "current",
           "call_pinned", "ENV_NAMES"]

ENV_NAMES = ("JAXPG_FR_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# jaxpg frames that only forward a call: the user-facing name is the outermost other one
_PLUMBING = frozenset({"wrapper", "<lambda>", "__call__", "launch", "call", "call_pinned"})
_ids = itertools.count(1)
_local = threading.local()


class CallRecord:
    """One collective call or jitted step of this process.

    Attributes:
        id: a per-process counter (the ring buffer's order; 0: an unused slot).
        group: the group's name.
        seq: the call's sequence number on the group.
        op: the op (``all_reduce``, ``send.meta``) or the step's name.
        kind: ``"collective"`` or ``"step"``.
        fingerprint: ``(op, static arguments, ((name, shape, dtype), ...))`` or None.
        caller: ``(code of the caller, line, code of the jaxpg function it called)`` or None.
        state: ``"started"``, ``"completed"``, ``"failed"`` or ``"timed out"``.
        started, ended: wall-clock times (``time.time()``); ``ended`` None until done.
        error: the failure's text, if any.
        collectives: a step's collectives, read from its compiled HLO (None if unknown).
        thread: the ident of the thread that dispatches it (its compile time is excluded
            from timeouts).
    """

    __slots__ = ("id", "group", "seq", "op", "kind", "fingerprint", "caller", "state",
                 "started", "ended", "error", "collectives", "thread")

    def __init__(self) -> None:
        self.id = 0
        self.group: str | None = None

    def reset(self, group: str, seq: int, op: str, kind: str, fingerprint: Any,
              caller: Any) -> None:
        """Makes this (new or reused) record the one of a call about to be dispatched."""
        self.id = next(_ids)
        self.group = group
        self.seq = seq
        self.op = op
        self.kind = kind
        self.fingerprint = fingerprint
        self.caller = caller
        self.state = "started"
        self.started = time.time()
        self.ended: float | None = None
        self.error: str | None = None
        self.collectives: tuple[str, ...] | None = None
        self.thread = threading.get_ident()

    def copy(self) -> CallRecord:
        other = CallRecord()
        for name in self.__slots__:
            setattr(other, name, getattr(self, name))
        return other

    def complete(self, rid: int | None = None) -> None:
        """Marks the call completed (``rid``: only if this record is still call ``rid``'s,
        not a ring slot reused since)."""
        if self.state == "started" and (rid is None or rid == self.id):
            self.state = "completed"
            self.ended = time.time()

    def fail(self, state: str, error: str, rid: int | None = None) -> None:
        """Marks the call failed or timed out (the first such mark stands)."""
        if rid is not None and rid != self.id:
            return
        if self.state in ("started", "completed"):
            self.state = state
            self.error = error
        if self.ended is None:
            self.ended = time.time()

    def called(self) -> str | None:
        """The jaxpg function the user called (``recv`` for a receive's ``send`` kernel)."""
        if self.caller is None or self.caller[2] is None:
            return None
        return getattr(self.caller[2], "co_qualname", self.caller[2].co_name)

    def location(self) -> str | None:
        """``file:line`` of the user's call (relative to the working directory when under
        it), when the recorder looked it up."""
        if self.caller is None or self.caller[0] is None:
            return None
        path = self.caller[0].co_filename
        try:
            relative = os.path.relpath(path)
            path = path if relative.startswith("..") else relative
        except ValueError:
            pass
        return f"{path}:{self.caller[1]}"


class _Recorder:
    """The ring buffer and each group's last call (one per process: ``recorder``).

    The ring is a pool of ``size`` records made once and reused in turn, so that a call
    allocates no record that outlives it (records that lived a thousand calls would be
    promoted through the garbage collector's generations and make its full collections
    more frequent; docs/debugging.md has the cost). A slot that still holds a group's last
    call is copied out before its reuse.
    """

    def __init__(self) -> None:
        self.size = 0
        self.ring: list[CallRecord] | None = None
        self._slots = itertools.count()
        self.last: dict[str, CallRecord] = {}  # group name -> its last call
        # group name -> (seq, fingerprint) of the call before its last, for a diagnosis
        self.prev: dict[str, tuple[int, Any]] = {}
        self.groups: dict[str, tuple[int, ...]] = {}  # group name -> its ranks

    @property
    def enabled(self) -> bool:
        return self.ring is not None

    def configure(self, size: int) -> None:
        """Keeps the last ``size`` calls (0: only each group's last call)."""
        self.size = size
        self.ring = [CallRecord() for _ in range(size)] if size > 0 else None
        self._slots = itertools.count()

    def start(self, group: Any, seq: int, op: str, kind: str, fingerprint: Any,
              caller: Any) -> CallRecord:
        """Records a call that is about to be dispatched and returns its record."""
        name = group.group_name
        ring = self.ring
        if ring is None:
            record = CallRecord()
        else:
            record = ring[next(self._slots) % self.size]
            held = record.group
            if held is not None and self.last.get(held) is record:
                self.last[held] = record.copy()  # that group's last call lives on
        before = self.last.get(name)
        if before is not None:
            self.prev[name] = (before.seq, before.fingerprint)
        record.reset(name, seq, op, kind, fingerprint, caller)
        if name not in self.groups:
            self.groups[name] = tuple(group.ranks)
        self.last[name] = record
        _local.record = record
        return record

    def records(self) -> list[CallRecord]:
        """The ring buffer's records, oldest first (each group's last call without one)."""
        if self.ring is not None:
            return sorted((r for r in self.ring if r.id), key=lambda r: r.id)
        return sorted(self.last.values(), key=lambda r: r.id)

    def forget(self) -> None:
        """Drops every record (``destroy_process_group``)."""
        self.last.clear()
        self.prev.clear()
        self.groups.clear()
        if self.ring is not None:
            self.configure(self.size)


recorder = _Recorder()


def current() -> CallRecord | None:
    """The record this thread started last (a recorded step attaches its HLO to it)."""
    return getattr(_local, "record", None)


def buffer_size_from_env() -> int:
    """``JAXPG_FR_BUFFER_SIZE`` (or torch's two names): the ring buffer's size; 0 when unset.

    Raises:
        ValueError: for a value that is not a non-negative integer.
    """
    for name in ENV_NAMES:
        value = os.environ.get(name, "").strip()
        if value:
            try:
                size = int(value)
            except ValueError:
                size = -1
            if size < 0:
                raise ValueError(
                    f"{name}={value!r} must be a non-negative integer: the number of calls "
                    "the flight recorder keeps (0 turns it off), e.g. 2000."
                )
            return size
    return 0


def _classify(code: Any) -> int:
    """0: the user's code; 1: a jaxpg function a user calls; 2: jaxpg plumbing."""
    if not code.co_filename.startswith(_PACKAGE):
        return 0
    return 2 if code.co_name in _PLUMBING else 1


_kinds: dict[int, tuple[Any, int]] = {}  # id(code) -> (code, its _classify)


def capture_caller() -> tuple[Any, int, Any] | None:
    """The user's frame that called into jaxpg: ``(code, line, code of the jaxpg function
    it called)``; None when the whole stack is jaxpg's (a runner thread). The function
    that calls this one is not counted (it is where the lookup happens). Each code object
    is classified once, so later lookups only walk the frames."""
    pinned = getattr(_local, "caller", None)
    if pinned is not None:
        return pinned
    frame = sys._getframe(2)
    api = None
    kinds = _kinds
    while frame is not None:
        code = frame.f_code
        entry = kinds.get(id(code))
        if entry is None or entry[0] is not code:
            entry = kinds[id(code)] = (code, _classify(code))
        kind = entry[1]
        if kind == 0:
            return code, frame.f_lineno, api
        if kind == 1:
            api = code
        frame = frame.f_back
    return None


def call_pinned(fn: Any, args: Any, kwargs: Any) -> Any:
    """Calls the public collective ``fn`` with its caller looked up once, here, where it is
    one frame away, for every record the call makes (with the recorder on; a call from
    jaxpg's own code is left to :func:`capture_caller`'s walk)."""
    if getattr(_local, "caller", None) is None:
        frame = sys._getframe(2)
        while True:  # over other decorators' wrappers (jaxpg plumbing) to the caller
            code = frame.f_code
            entry = _kinds.get(id(code))
            if entry is None or entry[0] is not code:
                entry = _kinds[id(code)] = (code, _classify(code))
            if entry[1] != 2 or frame.f_back is None:
                break
            frame = frame.f_back
        if entry[1] == 0:
            _local.caller = (code, frame.f_lineno, fn.__code__)
            try:
                return fn(*args, **kwargs)
            finally:
                _local.caller = None
    return fn(*args, **kwargs)
