"""Point-to-point: send, recv, isend, irecv, P2POp, batch_isend_irecv and permute.

Eager, between processes: a send is posted at once and matched to a receive as torch
matches it (group, source, tag, in order within a tag; any source for ``src=None``), and the
bytes move by one cached two-rank ``ppermute`` kernel (XLA's collectives), in a job-wide
order (``p2p_matching``). The send's record carries its shapes and dtypes, so a ``recv``
needs no ``tensor``. Between two ranks of one process, ``send`` leaves the array in a
mailbox and ``recv`` moves it to the receiving device with ``jax.device_put``. Host code
acts as this process's rank (see ``jaxpg.as_rank`` for processes with several).

In SPMD code every rank runs the same program, so a transfer names both ends: ``send(x,
dst, src=...)`` and ``recv(x, src, dst=...)`` pair up (by group, src, dst and tag) into one
``lax.ppermute``; ``permute(x, pairs)`` and ``batch_isend_irecv`` do several at once.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxpg.collectives import p2p_matching
from jaxpg.collectives._dispatch import check_input, check_inputs, resolve
from jaxpg.collectives.discarded import warns_if_discarded
from jaxpg.collectives.eager import before_collective, run_eager
from jaxpg.collectives.p2p_meta import DTYPE_CODES
from jaxpg.collectives.work import Work
from jaxpg.errors import DistTimeoutError

__all__ = ["send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv", "permute"]

_mailbox: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
_mail_cv = threading.Condition()


def _acting_rank(pg: Any, api: str) -> int:
    state = pg._world
    local = [r for r in state.local_ranks if r in pg.ranks]
    acting = state.acting_rank()
    if acting in pg.ranks:
        return acting
    if len(local) == 1 and getattr(state._acting, "rank", None) is None:
        return local[0]
    raise ValueError(
        f"{api}: the acting rank {acting} is not a member of group {pg.group_name!r} "
        f"(ranks {list(pg.ranks)}); use `with jaxpg.as_rank(r):` with one of {local}."
    )


def _peer(pg: Any, peer: int | None, group_peer: int | None, api: str, arg: str) -> int:
    if (peer is None) == (group_peer is None):
        raise ValueError(f"{api}: pass exactly one of {arg} and group_{arg}.")
    if group_peer is not None:
        return pg.global_rank(group_peer)
    if pg.group_rank(peer) < 0:
        raise ValueError(f"{api}: {arg}={peer} is not a rank of group {pg.group_name!r} "
                         f"(ranks {list(pg.ranks)}).")
    return int(peer)


def _check_naninf(tensor: Any, rank: int, api: str) -> None:
    flag = os.environ.get("JAXPG_PP_CHECK_NANINF", os.environ.get("FLAGS_pp_check_naninf", "0"))
    if flag.lower() in ("1", "true", "yes") and jnp.issubdtype(jnp.result_type(tensor),
                                                               jnp.inexact):
        if not bool(jnp.all(jnp.isfinite(tensor))):
            raise ValueError(f"{api}: tensor contains inf or nan values at rank {rank} "
                             "(JAXPG_PP_CHECK_NANINF is set).")


# ----------------------------------------------------------------- eager, across processes
def _pair_group(state: Any, a: int, b: int) -> Any:
    """The two-rank group a transfer between ``a`` and ``b`` runs on (kept on the world)."""
    from jaxpg.groups.process_group import ProcessGroup

    pairs = state.__dict__.setdefault("_pair_groups", {})
    key = (min(a, b), max(a, b))
    if key not in pairs:
        pairs[key] = ProcessGroup(state, key, name=f"p2p_{key[0]}_{key[1]}")
    return pairs[key]


def _wire(state: Any, src: int, dst: int, data: Any, api: str) -> Any:
    """Runs the two-rank ppermute kernel src -> dst; returns dst's result (or src's zeros)."""
    pair = _pair_group(state, src, dst)
    s, d = pair.group_rank(src), pair.group_rank(dst)
    return run_eager(pair, api, (s, d), lambda lay, x: lay.permute(x, [(s, d)]), {"x": data})


def _check_backend(state: Any, src: int, dst: int, api: str) -> None:
    """backend="mpi" cannot run a transfer between two of more than two processes."""
    from jaxpg.groups.backend import Backend, mpi_unsupported

    if state.backend == Backend.MPI:
        error = mpi_unsupported(_pair_group(state, src, dst), f"{api} from rank {src} to {dst}")
        if error is not None:
            raise error


def _engine(state: Any) -> p2p_matching.Engine:
    eng = p2p_matching.engine(state, lambda a, b, x: _wire(state, a, b, x, "send"))
    if not before_collective:
        before_collective.append(_flush_before_collective)
    return eng


def _flush_before_collective(api: str) -> None:
    """Before an eager collective: this process's earlier sends complete first."""
    eng = p2p_matching.current()
    if api == "send" or eng is None or eng.lock._is_owned():
        return
    if eng.busy():
        eng.flush(eng.state.timeout.total_seconds())


class P2PWork(Work):
    """The Work of ``isend``/``irecv`` across processes: ``wait`` moves the transfers.

    For a receive, ``result()`` is the array and ``source_rank()`` (torch's
    ``_source_rank()``) the global rank it came from (useful with ``src=None``).
    """

    def __init__(self, eng: Any, handle: Any, api: str, seconds: float,
                 what: Callable[[], str]):
        super().__init__(None, api)
        self._eng, self._handle, self._seconds, self._what = eng, handle, seconds, what

    def is_completed(self) -> bool:
        return self._handle.done or self._handle.error is not None

    def wait(self, timeout: Any = None) -> bool:
        h = self._handle
        if not h.done and h.error is None:
            seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
            seconds = self._seconds if seconds is None else seconds
            self._eng.wait(lambda: h.done or h.error is not None, seconds,
                           lambda: self._what(seconds))
        if h.error is not None:
            raise h.error
        self._result = getattr(h, "result", None)
        return True

    def source_rank(self) -> int:
        """The global rank a receive's data came from (after ``wait``)."""
        self.wait()
        if not hasattr(self._handle, "matched"):
            raise ValueError(f"{self._api}: source_rank() is only defined for a receive.")
        return self._handle.matched[0]

    _source_rank = source_rank


def _remote_isend(pg: Any, tensor: Any, me: int, dst: int, tag: int) -> P2PWork:
    state = pg._world
    _check_backend(state, me, dst, "send")
    arrays, several = p2p_matching.host_arrays(tensor)
    for a in arrays:
        if str(a.dtype) not in DTYPE_CODES:
            raise ValueError(f"send: dtype {str(a.dtype)!r} cannot be sent; supported: "
                             f"{sorted(DTYPE_CODES)}.")
    eng = _engine(state)
    handle = eng.post_send(me, dst, pg.group_name, tag, arrays, several)
    return P2PWork(eng, handle, "isend", pg.timeout.total_seconds(), lambda s: (
        f"isend: rank {dst} did not receive the send of rank {me} (group {pg.group_name!r}, "
        f"tag {tag}) within {s:.1f} s: no matching recv/irecv was posted there; ranks that "
        f"did not arrive: [{dst}]."))


def _remote_irecv(pg: Any, tensor: Any, src: int | None, me: int, tag: int) -> P2PWork:
    state = pg._world
    if src is None:
        local = [r for r in pg.ranks if r in state.local_ranks and r != me]
        if local:
            raise ValueError(
                f"recv: src=None (any source) is not supported when this process holds "
                f"other ranks of group {pg.group_name!r} ({local}); pass src.")
        sources = tuple(r for r in pg.ranks if r != me)
    else:
        _check_backend(state, src, me, "recv")
        sources = (src,)
    given = None if tensor is None else p2p_matching.signature(tensor)
    eng = _engine(state)
    handle = eng.post_recv(p2p_matching.RecvHandle(me, src, sources, pg.group_name, tag,
                                                   given))
    who = f"rank {src}" if src is not None else f"any of ranks {list(sources)}"
    return P2PWork(eng, handle, "irecv", pg.timeout.total_seconds(), lambda s: (
        f"recv: nothing arrived from {who} at rank {me} (group {pg.group_name!r}, tag "
        f"{tag}) within {s:.1f} s; ranks that did not arrive: "
        f"{[src] if src is not None else list(sources)}."))


# ------------------------------------------------------------------------------- public
def _send(tensor: Any, dst: int | None, group: Any, tag: int, group_dst: int | None,
          src: int | None, api: str) -> Any:
    """Posts a send; returns its Work (host code) or ``tensor`` (SPMD code)."""
    pg, ctx = resolve(group, api)
    check_inputs(tensor, api)
    dst_rank = _peer(pg, dst, group_dst, api, "dst")
    if ctx is not None:
        if src is None:
            raise ValueError(f"{api}: in SPMD code pass src= as well: every rank runs the same "
                             "program, so a transfer names both ends.")
        if src == dst_rank:
            raise ValueError(f"{api}: src={src} and dst={dst_rank} are the same rank; a rank "
                             "cannot send to itself.")
        ctx.__dict__.setdefault("mailbox", collections.defaultdict(list))[
            (pg.id, src, dst_rank, tag)].append(jnp.asarray(tensor))
        return tensor
    me = _acting_rank(pg, api) if src is None else int(src)
    if me == dst_rank:
        raise ValueError(f"{api}: dst={dst_rank} is this rank; a rank cannot send to itself.")
    state = pg._world
    if dst_rank in state.local_ranks:
        arr = [jnp.asarray(t) for t in tensor] if isinstance(tensor, (list, tuple)) else \
            jnp.asarray(tensor)
        with _mail_cv:
            _mailbox[(pg.id, me, dst_rank, tag)].append((me, arr))
            _mail_cv.notify_all()
        return Work(None, api)
    return _remote_isend(pg, tensor, me, dst_rank, tag)


def send(tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0,
         group_dst: int | None = None, *, src: int | None = None, meta: bool = True) -> Any:
    """Sends ``tensor`` to ``dst``. Blocks until the receiver has it when it is remote.

    Across processes a send is matched to a receive as torch matches it: by group, source
    and ``tag``, in order within a tag (``jaxpg.collectives.p2p_matching``).

    Args:
        tensor: the array, or a list of arrays (the receiver gets the list).
        dst: global rank of the receiver (or ``group_dst``, its group rank).
        group: the group (the world for None).
        tag: matches sends with receives.
        src: SPMD code only: the sending rank (every rank runs the same program).
        meta: kept for Paddle's ``send_meta``; shapes and dtypes always travel in the
            send's record, so ``recv`` never needs a shape.

    Returns:
        None (in SPMD code, ``tensor``: the send itself happens at the matching ``recv``).
    """
    del meta
    out = _send(tensor, dst, group, tag, group_dst, src, "send")
    if isinstance(out, Work):
        out.wait()
        return None
    return out


def _take_mail(pg: Any, sources: Sequence[int], me: int, tag: int,
               timeout: float) -> tuple[int, Any]:
    deadline = time.monotonic() + timeout
    with _mail_cv:
        while True:
            boxes = [_mailbox[(pg.id, s, me, tag)] for s in sources]
            full = [b for b in boxes if b]
            if full:
                return full[0].popleft()
            left = deadline - time.monotonic()
            if left <= 0:
                raise DistTimeoutError(
                    f"recv: nothing arrived from rank {list(sources)} at rank {me} (group "
                    f"{pg.group_name!r}, tag {tag}) within {timeout:.1f} s; ranks that did not "
                    f"arrive: {list(sources)}."
                )
            _mail_cv.wait(left)


class _DeferredWork(Work):
    """A receive between ranks of this process: it takes the mail at ``wait``."""

    def __init__(self, fn: Callable[[float | None], tuple[int, Any]], api: str):
        super().__init__(None, api)
        self._fn = fn
        self._done = False
        self._src: int | None = None

    def is_completed(self) -> bool:
        return self._done

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
            self._src, self._result = self._fn(seconds)
            self._done = True
        return super().wait()

    def source_rank(self) -> int:
        """The global rank the data came from (after ``wait``)."""
        self.wait()
        return self._src

    _source_rank = source_rank


def _recv(tensor: Any, src: int | None, group: Any, tag: int, group_src: int | None,
          dst: int | None, timeout: float | None, api: str) -> Any:
    """Posts a receive; returns its Work (host code) or the array (SPMD code)."""
    pg, ctx = resolve(group, api)
    if tensor is not None:
        check_inputs(tensor, api)
    if ctx is not None:
        src_rank = _peer(pg, src, group_src, api, "src")
        if dst is None or tensor is None:
            raise ValueError(f"{api}: in SPMD code pass dst= and tensor (shapes are static).")
        pending = ctx.__dict__.get("mailbox", {}).get((pg.id, src_rank, dst, tag))
        if not pending:
            raise ValueError(f"{api}: no matching send(src={src_rank}, dst={dst}, tag={tag}) "
                             "was traced before this recv.")
        moved = ctx.lowering(pg).permute(pending.pop(0), [(pg.group_rank(src_rank),
                                                         pg.group_rank(dst))])
        here = ctx.traced_group_rank(pg) == pg.group_rank(dst)
        return jnp.where(here, moved, jnp.asarray(tensor))
    src_rank = None if src is None and group_src is None else \
        _peer(pg, src, group_src, api, "src")
    me = _acting_rank(pg, api) if dst is None else int(dst)
    if me == src_rank:
        raise ValueError(f"{api}: src={src_rank} is this rank; a rank cannot receive from itself.")
    state = pg._world
    sources = [src_rank] if src_rank is not None else [r for r in pg.ranks if r != me]
    if all(r in state.local_ranks for r in sources):
        def take(seconds: float | None) -> tuple[int, Any]:
            wait_s = seconds if seconds is not None else (
                timeout if timeout is not None else pg.timeout.total_seconds())
            got, arr = _take_mail(pg, sources, me, tag, wait_s)
            if tensor is not None:
                sig = p2p_matching.signature
                if sig(tensor) != sig(arr):
                    raise ValueError(f"{api}: tensor describes {sig(tensor)}, but rank {got} "
                                     f"sent {sig(arr)}.")
            return got, jax.device_put(arr, state.devices[me])
        return _DeferredWork(take, "irecv")
    work = _remote_irecv(pg, tensor, src_rank, me, tag)
    if timeout is not None:
        work._seconds = timeout
    return work


@warns_if_discarded
def recv(tensor: Any = None, src: int | None = None, group: Any = None, tag: int = 0,
         group_src: int | None = None, *, dst: int | None = None, meta: bool = True,
         timeout: float | None = None, return_src: bool | None = None) -> Any:
    """Receives an array from ``src`` and **returns it; ``tensor`` is not changed** (torch
    fills ``tensor`` in place: ``dist.recv(t, src)`` is ``t = jaxpg.recv(t, src)`` here).

    ``tensor`` gives the shape and dtype to check; it may be None (a send's record carries
    them). With neither ``src`` nor ``group_src`` it receives from any rank of the group, as
    torch does, and returns what torch writes and what it returns: ``(array, sender's global
    rank)`` (``array, src = jaxpg.recv(t)`` for torch's ``src = dist.recv(t)``).
    ``return_src=True`` gives that pair for a named ``src`` too, ``return_src=False`` the
    array alone. In SPMD code pass ``dst=`` too; non-receivers get ``tensor`` back.
    """
    del meta
    if return_src is None:
        return_src = src is None and group_src is None
    out = _recv(tensor, src, group, tag, group_src, dst, timeout, "recv")
    if not isinstance(out, Work):
        return out
    out.wait()
    return (out._result, out.source_rank()) if return_src else out._result


def isend(tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0,
          group_dst: int | None = None, **kw: Any) -> Work:
    """Sends asynchronously; returns a Work at once, before the receive is posted."""
    kw.pop("meta", None)
    out = _send(tensor, dst, group, tag, group_dst, kw.pop("src", None), "isend")
    if kw:
        raise TypeError(f"isend: unexpected keyword(s) {sorted(kw)}.")
    return out if isinstance(out, Work) else Work(out, "isend")


def irecv(tensor: Any = None, src: int | None = None, group: Any = None, tag: int = 0,
          group_src: int | None = None, **kw: Any) -> Work:
    """Receives asynchronously; ``wait()`` then **``result()`` gives the array**: unlike
    torch, ``tensor`` is not filled (``t = jaxpg.irecv(t, src).result()``). The receive is
    posted now; with ``src=None`` the Work's ``source_rank()`` (torch's ``_source_rank()``)
    names the sender."""
    kw.pop("meta", None)
    out = _recv(tensor, src, group, tag, group_src, kw.pop("dst", None), kw.pop("timeout", None),
                "irecv")
    if kw:
        raise TypeError(f"irecv: unexpected keyword(s) {sorted(kw)}.")
    return out if isinstance(out, Work) else Work(out, "irecv")


class P2POp(NamedTuple):
    """One operation of ``batch_isend_irecv``: ``P2POp(jaxpg.isend, x, peer)``."""

    op: Callable[..., Any]
    tensor: Any
    peer: int | None = None
    group: Any = None
    tag: int = 0
    group_peer: int | None = None


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Work]:
    """Runs a list of isend/irecv as one exchange and returns their Works.

    Outgoing tensors are checked for NaN/Inf first when ``JAXPG_PP_CHECK_NANINF=1`` (Paddle's
    ``FLAGS_pp_check_naninf``). Every operation is posted at once; the transfers run while
    the Works are waited on, in an order all processes agree on, so the lists may be in
    any order.
    """
    api = "batch_isend_irecv"
    if not p2p_op_list:
        raise ValueError(f"{api}: p2p_op_list is empty.")
    # jaxpg.isend is isend wrapped for non-members (collectives/__init__): compare the inner
    p2p_op_list = [p._replace(op=getattr(p.op, "__wrapped__", p.op)) for p in p2p_op_list]
    groups = {id(p.group) for p in p2p_op_list}
    if len(groups) > 1:
        raise ValueError(f"{api}: every P2POp must use the same group, as in torch.")
    for p in p2p_op_list:
        if p.op not in (isend, irecv):
            raise ValueError(f"{api}: P2POp.op must be jaxpg.isend or jaxpg.irecv; got {p.op!r}.")
    pg, _ = resolve(p2p_op_list[0].group, api)
    me = _acting_rank(pg, api)
    for p in p2p_op_list:
        if p.op is isend:
            _check_naninf(p.tensor, me, api)

    works = []
    for p in p2p_op_list:
        if p.op is isend:
            works.append(isend(p.tensor, p.peer, p.group, p.tag, p.group_peer))
        else:
            works.append(irecv(p.tensor, p.peer, p.group, p.tag, p.group_peer))
    return works


@warns_if_discarded
def permute(tensor: Any, pairs: Sequence[tuple[int, int]], group: Any = None) -> Any:
    """SPMD or eager: sends rank ``a``'s ``tensor`` to rank ``b`` for each ``(a, b)`` of
    group ranks (a partial permutation); ranks that receive nothing get zeros.

    This is ``lax.ppermute`` over the group; the pipeline's stage transfer is built on it.
    """
    api = "permute"
    pg, ctx = resolve(group, api)
    check_input(tensor, api)
    srcs = [a for a, _ in pairs]
    dsts = [b for _, b in pairs]
    k = pg.size()
    for a, b in pairs:
        if not (0 <= a < k and 0 <= b < k):
            raise ValueError(f"{api}: pair ({a}, {b}) is out of range for group size {k}.")
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(f"{api}: pairs={list(pairs)} must not repeat a source or destination.")
    pairs = [(int(a), int(b)) for a, b in pairs]
    if ctx is not None:
        return ctx.lowering(pg).permute(jnp.asarray(tensor), pairs)
    return run_eager(pg, api, tuple(pairs), lambda lay, x: lay.permute(x, pairs),
                     {"x": tensor})
