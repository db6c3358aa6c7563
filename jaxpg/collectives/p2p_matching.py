"""Point-to-point across processes as torch matches it: by source, tag and order.

A send never waits for its receive to be posted. ``isend`` leaves the arrays in this
process's outbox and writes a small record to the coordination service's key/value store
(``s/<src>/<dst>/<n>``: group, tag, shapes and dtypes, the n-th send from ``src`` to
``dst``). A receive is posted locally; the receiver *matches* its posted receives, in the
order they were posted, to the senders' records: the first unmatched send from the
source (any source for ``src=None``: the earliest posted) with the same group and tag, as
torch's gloo matches (per source, per tag, in order within a tag).

Each match takes the next number of one job-wide counter (the store's atomic ``add``) and
is written as ``x/<id>``. The bytes then move by XLA's collectives (the two-rank
``ppermute`` kernel of ``p2p``), and every process runs the transfers it takes part in
in increasing ``id`` order, after it has read every record below. Two processes therefore
always run their shared transfers in the same order, and the transfer with the lowest
unfinished id can always run: no cycle of processes waiting on each other, so "every rank
``isend``\\ s to all, then ``irecv``\\ s from all" completes.

Transfers run while this process is inside a point-to-point wait (``send``, ``recv``,
``Work.wait``) or before its next eager collective, which first completes this process's
outstanding sends (``flush``): jaxpg has no background thread that moves bytes.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxpg.errors import DistTimeoutError

__all__ = ["Engine", "engine", "SendHandle", "RecvHandle"]

_POLL_S = 0.002


@dataclasses.dataclass
class SendHandle:
    """One posted send: its arrays until the transfer ran, then ``done``."""

    src: int
    dst: int
    n: int
    group: str
    tag: int
    arrays: list[Any]
    done: bool = False
    error: BaseException | None = None


@dataclasses.dataclass
class RecvHandle:
    """One posted receive; ``src`` None receives from any rank of ``sources``."""

    dst: int
    src: int | None
    sources: tuple[int, ...]
    group: str
    tag: int
    given: list[tuple[tuple[int, ...], str]] | None  # shapes and dtypes of ``tensor``
    matched: tuple[int, int] | None = None  # (src, n)
    metas: list[tuple[tuple[int, ...], str]] | None = None
    several: bool = False
    result: Any = None
    done: bool = False
    error: BaseException | None = None


class Engine:
    """This process's cross-process point-to-point state (one per world)."""

    def __init__(self, state: Any, wire: Callable[[int, int, Any], Any]):
        self.state = state
        self.store = state.store
        self.wire = wire
        self.lock = threading.RLock()
        self.sent: dict[tuple[int, int], int] = {}
        self.outbox: dict[tuple[int, int, int], SendHandle] = {}
        self.recvs: list[RecvHandle] = []
        self.read_next: dict[tuple[int, int], int] = {}
        self.records: dict[tuple[int, int], list[dict]] = {}
        self.scanned = 0
        self.todo: dict[int, tuple[str, Any]] = {}

    # ------------------------------------------------------------------ the store
    def _get(self, key: str) -> bytes | None:
        try_get = getattr(self.store, "_try_get", None)
        key = f"jaxpg_p2p/{key}"
        if try_get is not None:
            return try_get(key)
        return self.store.get(key) if self.store.check([key]) else None

    def _set(self, key: str, value: str) -> None:
        self.store.set(f"jaxpg_p2p/{key}", value)

    def _counter(self, amount: int) -> int:
        return int(self.store.add("jaxpg_p2p/next", amount))

    # ------------------------------------------------------------------ posting
    def post_send(self, src: int, dst: int, group: str, tag: int, arrays: list[Any],
                  several: bool) -> SendHandle:
        with self.lock:
            n = self.sent.get((src, dst), 0)
            self.sent[(src, dst)] = n + 1
            handle = SendHandle(src, dst, n, group, tag, arrays)
            self.outbox[(src, dst, n)] = handle
            record = {"g": group, "t": tag, "several": several, "at": time.time(),
                      "m": [[list(a.shape), str(a.dtype)] for a in arrays]}
            self._set(f"s/{src}/{dst}/{n}", json.dumps(record))
            return handle

    def post_recv(self, handle: RecvHandle) -> RecvHandle:
        with self.lock:
            self.recvs.append(handle)
            self._match()
            return handle

    def busy(self) -> bool:
        return bool(self.outbox or self.recvs or self.todo)

    # ------------------------------------------------------------------ progress
    def _read_records(self, src: int, dst: int) -> list[dict]:
        pending = self.records.setdefault((src, dst), [])
        n = self.read_next.get((src, dst), 0)
        while True:
            raw = self._get(f"s/{src}/{dst}/{n}")
            if raw is None:
                break
            rec = json.loads(raw)
            rec["n"], rec["src"] = n, src
            pending.append(rec)
            n += 1
        self.read_next[(src, dst)] = n
        return pending

    def _match(self) -> None:
        """Matches posted receives (in posting order) to the senders' records."""
        for r in [r for r in self.recvs if r.matched is None and r.error is None]:
            best = None
            for src in ((r.src,) if r.src is not None else r.sources):
                for rec in self._read_records(src, r.dst):
                    if rec["g"] == r.group and rec["t"] == r.tag:
                        if best is None or rec["at"] < best["at"]:
                            best = rec
                        break
            if best is None:
                continue
            self.records[(best["src"], r.dst)].remove(best)
            metas = [(tuple(s), d) for s, d in best["m"]]
            r.matched, r.metas, r.several = (best["src"], best["n"]), metas, best["several"]
            ok = r.given is None or r.given == metas
            if not ok:
                r.error = ValueError(
                    f"recv: tensor describes {r.given}, but rank {best['src']} sent {metas} "
                    f"(group {r.group!r}, tag {r.tag}); pass a tensor of the sent shape and "
                    "dtype, or none.")
            xid = self._counter(1)
            self._set(f"x/{xid}", json.dumps([best["src"], r.dst, best["n"],
                                             "" if ok else str(r.error)]))
            if ok:
                self.todo[xid] = ("recv", r)

    def _scan(self) -> None:
        """Reads every transfer record up to the counter; keeps this process's sends."""
        top = self._counter(0)
        local = self.state.local_ranks
        for xid in range(self.scanned + 1, top + 1):
            raw = self._get(f"x/{xid}")
            while raw is None:  # its receiver writes it right after taking the number
                time.sleep(_POLL_S)
                raw = self._get(f"x/{xid}")
            src, dst, n, err = json.loads(raw)
            if src in local and dst not in local:
                handle = self.outbox.get((src, dst, n))
                if handle is not None:
                    if err:
                        handle.error = ValueError(f"send to rank {dst}: {err}")
                        del self.outbox[(src, dst, n)]
                    else:
                        self.todo[xid] = ("send", handle)
        self.scanned = max(self.scanned, top)

    def _run(self, xid: int) -> None:
        role, h = self.todo.pop(xid)
        if role == "send":
            try:
                for a in h.arrays:
                    self.wire(h.src, h.dst, a)
            except BaseException as err:  # noqa: BLE001 (handed to the Work)
                h.error = err
            h.done = True
            self.outbox.pop((h.src, h.dst, h.n), None)
            return
        src, _ = h.matched
        try:
            out = [self.wire(src, h.dst, jnp.zeros(s, d)) for s, d in h.metas]
            h.result = out if h.several else out[0]
        except BaseException as err:  # noqa: BLE001 (handed to the Work)
            h.error = err
        h.done = True
        self.recvs.remove(h)

    def step(self) -> bool:
        """Matches, reads the transfer records and runs what can run; True if it did."""
        with self.lock:
            self._match()
            self._scan()
            ran = False
            for xid in sorted(self.todo):
                if xid <= self.scanned:
                    self._run(xid)
                    ran = True
            for r in [r for r in self.recvs if r.error is not None]:
                r.done = True
                self.recvs.remove(r)
            return ran

    def wait(self, finished: Callable[[], bool], seconds: float,
             what: Callable[[], str]) -> None:
        """Makes progress until ``finished()``; DistTimeoutError after ``seconds``."""
        deadline = time.monotonic() + seconds
        while not finished():
            if not self.step() and not finished():
                if time.monotonic() > deadline:
                    raise DistTimeoutError(what())
                time.sleep(_POLL_S)

    def flush(self, seconds: float) -> None:
        """Completes this process's outstanding sends (before an eager collective)."""
        self.wait(lambda: not self.outbox and not self.todo, seconds,
                  lambda: ("a collective waited for this process's earlier sends to be "
                           f"received: {sorted(self.outbox)} ((src, dst, n)) were not received "
                           f"within {seconds:.1f} s; post the matching recv/irecv on the "
                           "receiver before its next collective."))


_engines: dict[int, Engine] = {}


def engine(state: Any, wire: Callable[[int, int, Any], Any]) -> Engine:
    """This world's Engine (made on first use)."""
    eng = _engines.get(id(state))
    if eng is None or eng.state is not state:
        _engines.clear()
        eng = _engines[id(state)] = Engine(state, wire)
    return eng


def current() -> Engine | None:
    """The Engine of the latest world, if point-to-point was used in it."""
    return next(iter(_engines.values()), None)


def host_arrays(tensor: Any) -> tuple[list[Any], bool]:
    """The arrays of ``tensor`` (one array or a list) and whether it was a list."""
    several = isinstance(tensor, (list, tuple))
    arrays = [jnp.asarray(t) for t in tensor] if several else [jnp.asarray(tensor)]
    return arrays, several


def signature(tensor: Any) -> list[tuple[tuple[int, ...], str]]:
    """Shapes and dtypes of one array or a list, as records hold them."""
    items = tensor if isinstance(tensor, (list, tuple)) else [tensor]
    return [(tuple(np.shape(t)), str(jnp.result_type(t))) for t in items]
