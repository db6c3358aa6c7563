"""Point-to-point: send, recv, isend, irecv, P2POp, batch_isend_irecv and permute.

Eager, between two processes: both run one cached two-rank ``ppermute`` kernel (XLA moves
the bytes). A ``recv`` that is not given a ``tensor`` learns the shape and dtype from a
metadata header the sender sends first (``p2p_meta``: length, then message, as Paddle's
``send_meta``/``recv_meta``). Between two ranks of one process, ``send`` leaves the array
in a mailbox and ``recv`` moves it to the receiving device with ``jax.device_put``. Host
code acts as this process's rank (see ``jaxpg.as_rank`` for processes with several).

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
import numpy as np

from jaxpg.collectives._dispatch import check_input, check_inputs, resolve
from jaxpg.collectives.discarded import warns_if_discarded
from jaxpg.collectives.eager import run_eager
from jaxpg.collectives.p2p_meta import TensorMeta, decode_meta, encode_meta
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


def _remote_send(state: Any, tensor: Any, src: int, dst: int, meta: bool) -> None:
    _check_backend(state, src, dst, "send")
    several = isinstance(tensor, (list, tuple))
    arrays = [jnp.asarray(t) for t in tensor] if several else [jnp.asarray(tensor)]
    if meta:
        header = encode_meta([TensorMeta(tuple(a.shape), str(a.dtype)) for a in arrays],
                             several=several)
        _wire(state, src, dst, np.array([header.size], np.int32), "send.meta_len")
        _wire(state, src, dst, header, "send.meta")
    for a in arrays:
        _wire(state, src, dst, a, "send")


def _remote_recv(state: Any, template: Any, src: int, dst: int, meta: bool) -> Any:
    _check_backend(state, src, dst, "recv")
    given = None
    if template is not None:
        items = template if isinstance(template, (list, tuple)) else [template]
        given = [TensorMeta(tuple(np.shape(t)), str(jnp.result_type(t))) for t in items]
    if meta:
        n = int(np.asarray(_wire(state, src, dst, np.zeros(1, np.int32), "send.meta_len"))[0])
        words = np.asarray(_wire(state, src, dst, np.zeros(n, np.int32), "send.meta"))
        metas, several = decode_meta(words.tolist())
        if given is not None and [(m.shape, m.dtype) for m in given] != [
                (m.shape, m.dtype) for m in metas]:
            raise ValueError(
                f"recv: tensor describes {[(m.shape, m.dtype) for m in given]}, but rank {src} "
                f"sent {[(m.shape, m.dtype) for m in metas]}."
            )
    elif given is None:
        raise ValueError("recv: pass tensor (shape and dtype) when the sender uses meta=False.")
    else:
        metas, several = given, isinstance(template, (list, tuple))
    out = [_wire(state, src, dst, jnp.zeros(m.shape, m.dtype), "send") for m in metas]
    return out if several else out[0]


# ------------------------------------------------------------------------------- public
def send(tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0,
         group_dst: int | None = None, *, src: int | None = None, meta: bool = True) -> Any:
    """Sends ``tensor`` to ``dst``. Blocks until the receiver has it when it is remote.

    Args:
        tensor: the array, or a list of arrays (the header then describes each).
        dst: global rank of the receiver (or ``group_dst``, its group rank).
        group: the group (the world for None).
        tag: matches sends with receives.
        src: SPMD code only: the sending rank (every rank runs the same program).
        meta: send the metadata header first, so ``recv`` needs no shape (remote only).

    Returns:
        None (in SPMD code, ``tensor``: the send itself happens at the matching ``recv``).
    """
    api = "send"
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
    arr = [jnp.asarray(t) for t in tensor] if isinstance(tensor, (list, tuple)) else \
        jnp.asarray(tensor)
    state = pg._world
    if dst_rank in state.local_ranks:
        with _mail_cv:
            _mailbox[(pg.id, me, dst_rank, tag)].append(arr)
            _mail_cv.notify_all()
        return None
    _remote_send(state, arr, me, dst_rank, meta)
    return None


def _take_mail(pg: Any, src: int, me: int, tag: int, timeout: float) -> jax.Array:
    deadline = time.monotonic() + timeout
    with _mail_cv:
        box = _mailbox[(pg.id, src, me, tag)]
        while not box:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DistTimeoutError(
                    f"recv: nothing arrived from rank {src} at rank {me} (group "
                    f"{pg.group_name!r}, tag {tag}) within {timeout:.1f} s; ranks that did not "
                    f"arrive: [{src}]."
                )
            _mail_cv.wait(left)
        return box.popleft()


@warns_if_discarded
def recv(tensor: Any = None, src: int | None = None, group: Any = None, tag: int = 0,
         group_src: int | None = None, *, dst: int | None = None, meta: bool = True,
         timeout: float | None = None) -> Any:
    """Receives an array from ``src`` and **returns it; ``tensor`` is not changed** (torch
    fills ``tensor`` in place: ``dist.recv(t, src)`` is ``t = jaxpg.recv(t, src)`` here).

    ``tensor`` gives the shape and dtype; it may be None when the sender sends the metadata
    header (the default). In SPMD code pass ``dst=`` too; non-receivers get ``tensor`` back.
    """
    api = "recv"
    pg, ctx = resolve(group, api)
    if tensor is not None:
        check_inputs(tensor, api)
    src_rank = _peer(pg, src, group_src, api, "src")
    if ctx is not None:
        if dst is None or tensor is None:
            raise ValueError(f"{api}: in SPMD code pass dst= and tensor (shapes are static).")
        pending = ctx.__dict__.get("mailbox", {}).get((pg.id, src_rank, dst, tag))
        if not pending:
            raise ValueError(f"{api}: no matching send(src={src_rank}, dst={dst}, tag={tag}) "
                             "was traced before this recv.")
        moved = ctx.layout(pg).permute(pending.pop(0), [(pg.group_rank(src_rank),
                                                         pg.group_rank(dst))])
        here = ctx.traced_group_rank(pg) == pg.group_rank(dst)
        return jnp.where(here, moved, jnp.asarray(tensor))
    me = _acting_rank(pg, api) if dst is None else int(dst)
    if me == src_rank:
        raise ValueError(f"{api}: src={src_rank} is this rank; a rank cannot receive from itself.")
    state = pg._world
    wait_s = timeout if timeout is not None else pg.timeout.total_seconds()
    if src_rank in state.local_ranks:
        arr = _take_mail(pg, src_rank, me, tag, wait_s)
        if tensor is not None:
            sig = lambda t: [(tuple(np.shape(a)), str(jnp.result_type(a)))
                             for a in (t if isinstance(t, (list, tuple)) else [t])]
            if sig(tensor) != sig(arr):
                raise ValueError(f"{api}: tensor describes {sig(tensor)}, but rank {src_rank} "
                                 f"sent {sig(arr)}.")
        return jax.device_put(arr, state.devices[me])
    return _remote_recv(state, tensor, src_rank, me, meta)


class _DeferredWork(Work):
    """A Work whose result is computed at ``wait`` (a receive that may not have arrived)."""

    def __init__(self, fn: Callable[[float | None], Any], api: str):
        super().__init__(None, api)
        self._fn = fn
        self._done = False

    def is_completed(self) -> bool:
        return self._done

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
            self._result = self._fn(seconds)
            self._done = True
        return super().wait()


def isend(tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0,
          group_dst: int | None = None, **kw: Any) -> Work:
    """Sends asynchronously; returns a Work."""
    return Work(send(tensor, dst, group, tag, group_dst, **kw), "isend")


def irecv(tensor: Any = None, src: int | None = None, group: Any = None, tag: int = 0,
          group_src: int | None = None, **kw: Any) -> Work:
    """Receives asynchronously; ``wait()`` then **``result()`` gives the array**: unlike
    torch, ``tensor`` is not filled (``t = jaxpg.irecv(t, src).result()``)."""
    return _DeferredWork(
        lambda t: recv(tensor, src, group, tag, group_src, **({"timeout": t} if t else {}),
                       **kw), "irecv")


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
    ``FLAGS_pp_check_naninf``). Transfers run in a canonical order (by rank pair), so two
    processes that list their halves in any order cannot deadlock.
    """
    api = "batch_isend_irecv"
    if not p2p_op_list:
        raise ValueError(f"{api}: p2p_op_list is empty.")
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

    def order(item: tuple[int, P2POp]) -> tuple:
        _, p = item
        peer = _peer(pg, p.peer, p.group_peer, api, "peer")
        a, b = (me, peer) if p.op is isend else (peer, me)
        return (min(a, b), max(a, b), a, item[0])

    works: dict[int, Work] = {}
    for i, p in sorted(enumerate(p2p_op_list), key=order):
        if p.op is isend:
            works[i] = isend(p.tensor, p.peer, p.group, p.tag, p.group_peer)
        else:
            w = irecv(p.tensor, p.peer, p.group, p.tag, p.group_peer)
            peer = _peer(pg, p.peer, p.group_peer, api, "peer")
            if peer not in pg._world.local_ranks:
                w.wait()  # remote transfers run now, in the canonical order
            works[i] = w
    return [works[i] for i in range(len(p2p_op_list))]


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
        return ctx.layout(pg).permute(jnp.asarray(tensor), pairs)
    return run_eager(pg, api, tuple(pairs), lambda lay, x: lay.permute(x, pairs),
                     {"x": tensor})
