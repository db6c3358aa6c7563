"""Cases from PyTorch's own distributed tests, run by jaxpg and (where installed) by torch
gloo in the same processes, on the same inputs.

Each case computes this rank's result with jaxpg and, when torch is importable, with
torch.distributed (gloo, its own TCPStore on ``JAXPG_TORCH_PORT``), and checks both against
the expected value, computed with numpy from every rank's inputs. Prints ``CHECK <case> ok``
(jaxpg) and ``TORCH <case> ok`` (torch) per case; any mismatch raises.
"""

import datetime
import os
import sys
import traceback
import warnings

import numpy as np

import jaxpg

try:
    import torch
    import torch.distributed as dist
except ImportError:  # the newest leg has no torch: the numpy expectations still check jaxpg
    torch = dist = None

jaxpg.init_process_group(timeout=datetime.timedelta(seconds=60))
R, W = jaxpg.get_rank(), jaxpg.get_world_size()
if dist is not None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['JAXPG_TORCH_PORT']}",
                            rank=R, world_size=W, timeout=datetime.timedelta(seconds=60))

CASES = []


def case(fn):
    CASES.append(fn)
    return fn


def same(name, got, want):
    got = [np.asarray(g) for g in got] if isinstance(got, list) else np.asarray(got)
    want = [np.asarray(x) for x in want] if isinstance(want, list) else np.asarray(want)
    if isinstance(want, list):
        ok = len(got) == len(want) and all(g.shape == x.shape and np.array_equal(g, x)
                                           for g, x in zip(got, want))
    else:
        ok = got.shape == want.shape and np.array_equal(got, want)
    if not ok:
        raise AssertionError(f"{name} on rank {R}: got {got!r}, want {want!r}")


def t(x):
    return torch.from_numpy(np.ascontiguousarray(x))


# ------------------------------------------------------------------ point-to-point
@case
def p2p_tags_out_of_order():
    """Rank 0 isends A (tag 1) then B (tag 2); rank 1 receives tag 2 first."""
    a, b = np.full(3, 1.0, np.float32), np.full(3, 2.0, np.float32)
    want = [b, a] if R == 1 else []

    def jx():
        if R == 0:
            w1, w2 = jaxpg.isend(a, 1, tag=1), jaxpg.isend(b, 1, tag=2)
            w1.wait(), w2.wait()
            return []
        if R == 1:
            return [jaxpg.recv(np.zeros(3, np.float32), 0, tag=2),
                    jaxpg.irecv(np.zeros(3, np.float32), 0, tag=1).result()]
        return []

    def th():
        if R == 0:
            w1, w2 = dist.isend(t(a), 1, tag=1), dist.isend(t(b), 1, tag=2)
            w1.wait(), w2.wait()
            return []
        if R == 1:
            x, y = torch.zeros(3), torch.zeros(3)
            dist.recv(x, 0, tag=2)
            dist.irecv(y, 0, tag=1).wait()
            return [x.numpy(), y.numpy()]
        return []
    return jx, th, want


@case
def p2p_any_source():
    """test_send_recv_any_source: every other rank sends its rank to rank 0."""
    want = [np.array([s, s], np.int32) for s in range(1, W)] if R == 0 else []

    def jx():
        if R != 0:
            jaxpg.send(np.array([R], np.int32), 0)
            return []
        got = [jaxpg.recv(np.zeros(1, np.int32), return_src=True) for _ in range(W - 1)]
        return sorted([np.array([int(v[0]), s], np.int32) for v, s in got], key=lambda v: v[1])

    def th():
        if R != 0:
            dist.send(torch.tensor([R], dtype=torch.int32), 0)
            return []
        out = []
        for _ in range(W - 1):
            x = torch.zeros(1, dtype=torch.int32)
            s = dist.recv(x)
            out.append(np.array([int(x[0]), s], np.int32))
        return sorted(out, key=lambda v: v[1])
    return jx, th, want


@case
def p2p_isend_all_then_irecv_all():
    """test_send_recv_all_to_all: every rank isends to all, then irecvs from all."""
    want = [np.full(2, 10 * s + R, np.int32) for s in range(W) if s != R]

    def jx():
        sends = [jaxpg.isend(np.full(2, 10 * R + d, np.int32), d) for d in range(W) if d != R]
        recvs = [jaxpg.irecv(np.zeros(2, np.int32), s) for s in range(W) if s != R]
        for w in sends:
            w.wait()
        return [w.result() for w in recvs]

    def th():
        sends = [dist.isend(torch.full((2,), 10 * R + d, dtype=torch.int32), d)
                 for d in range(W) if d != R]
        outs = {s: torch.zeros(2, dtype=torch.int32) for s in range(W) if s != R}
        recvs = [dist.irecv(outs[s], s) for s in outs]
        for w in sends + recvs:
            w.wait()
        return [outs[s].numpy() for s in outs]
    return jx, th, want


@case
def batch_isend_irecv_ring():
    """test_batch_isend_irecv_ring_exchange_nccl's pattern on gloo (with a tag)."""
    nxt, prv = (R + 1) % W, (R - 1) % W
    want = np.full(2, prv, np.float32)

    def jx():
        ops = [jaxpg.P2POp(jaxpg.isend, np.full(2, R, np.float32), nxt, tag=3),
               jaxpg.P2POp(jaxpg.irecv, np.zeros(2, np.float32), prv, tag=3)]
        works = jaxpg.batch_isend_irecv(ops)
        for w in works:
            w.wait()
        return works[1].result()

    def th():
        out = torch.zeros(2)
        ops = [dist.P2POp(dist.isend, torch.full((2,), float(R)), nxt, tag=3),
               dist.P2POp(dist.irecv, out, prv, tag=3)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return out.numpy()
    return jx, th, want


@case
def p2p_any_source_returns_sender():
    """test_send_recv_any_source's torch line ``src = dist.recv(x)``: without ``src`` the
    receive gives the sender's rank (jaxpg: ``x, src = jaxpg.recv(x)``)."""
    want = np.array(sorted([s, s] for s in range(1, W)), np.int32) if R == 0 else np.zeros(0)

    def jx():
        if R != 0:
            jaxpg.send(np.array([R], np.int32), 0, tag=5)
            return np.zeros(0)
        got = []
        for _ in range(W - 1):
            x, s = jaxpg.recv(np.zeros(1, np.int32), tag=5)
            got.append([int(x[0]), s])
        return np.array(sorted(got), np.int32)

    def th():
        if R != 0:
            dist.send(torch.tensor([R], dtype=torch.int32), 0, tag=5)
            return np.zeros(0)
        got = []
        for _ in range(W - 1):
            x = torch.zeros(1, dtype=torch.int32)
            s = dist.recv(x, tag=5)
            got.append([int(x[0]), s])
        return np.array(sorted(got), np.int32)
    return jx, th, want


# ------------------------------------------------------------------ argument rules
@case
def reduce_scatter_uneven_chunks():
    """test_reduce_scatter: chunk i has i + 1 elements."""
    chunks = [np.full(i + 1, R + 1, np.float32) for i in range(W)]
    want = np.full(R + 1, sum(r + 1 for r in range(W)), np.float32)

    def jx():
        return jaxpg.reduce_scatter(chunks)

    def th():
        out = torch.zeros(R + 1)
        dist.reduce_scatter(out, [t(c) for c in chunks])
        return out.numpy()
    return jx, th, want


@case
def scatter_empty_list_off_source():
    """_test_scatter_helper: scatter_list=[] on the ranks that are not the source."""
    src = W - 1
    rows = [np.full(2, 7 * i, np.float32) for i in range(W)]
    want = rows[R]

    def jx():
        return jaxpg.scatter(np.zeros(2, np.float32), rows if R == src else [], src=src)

    def th():
        out = torch.zeros(2)
        dist.scatter(out, [t(x) for x in rows] if R == src else [], src=src)
        return out.numpy()
    return jx, th, want


@case
def scatter_object_list_input_everywhere():
    """test_subpg_scatter_object: the input list is passed on every rank; only src's counts."""
    objs = [{"rank": i, "from": "src"} for i in range(W)]
    mine = [{"rank": -1, "from": "ignored"} for _ in range(W)]
    want = np.array([R, 1])

    def as_arr(o):
        return np.array([o["rank"], o["from"] == "src"])

    def jx():
        return as_arr(jaxpg.scatter_object_list(objs if R == 0 else mine, src=0))

    def th():
        out = [None]
        dist.scatter_object_list(out, objs if R == 0 else mine, src=0)
        return as_arr(out[0])
    return jx, th, want


@case
def new_group_unsorted():
    """_test_new_group_ordered: sort_ranks=False keeps the order (ranks reversed)."""
    order = list(reversed(range(W)))
    x = np.full(2, R + 1, np.float32)
    want = np.array([order.index(R), W], np.float32)  # group rank, broadcast from group rank 0

    def jx():
        g = jaxpg.new_group(order, sort_ranks=False)
        b = jaxpg.broadcast(x, group_src=0, group=g)
        return np.array([jaxpg.get_rank(g), b[0]], np.float32)

    def th():
        g = dist.new_group(order, sort_ranks=False)
        y = t(x.copy())
        dist.broadcast(y, group_src=0, group=g)
        return np.array([dist.get_rank(g), float(y[0])], np.float32)
    return jx, th, want


@case
def new_group_local_synchronization():
    """use_local_synchronization=True: only the members (ranks 0 and 1) call new_group."""
    want = np.full(2, 3.0, np.float32) if R < 2 else np.zeros(0)

    def jx():
        if R >= 2:
            return np.zeros(0)
        g = jaxpg.new_group([0, 1], use_local_synchronization=True, group_desc="pair")
        return jaxpg.all_reduce(np.full(2, R + 1, np.float32), group=g)

    def th():
        if R >= 2:
            return np.zeros(0)
        g = dist.new_group([0, 1], use_local_synchronization=True, group_desc="pair")
        y = torch.full((2,), float(R + 1))
        dist.all_reduce(y, group=g)
        return y.numpy()
    return jx, th, want


@case
def warn_not_in_group():
    """_test_warn_not_in_group: a non-member warns (torch 2.13's text) and returns."""
    text = f"Running all_reduce on global rank {R} which does not belong to the given group."
    want = np.array([R != 0])  # every rank but 0 is outside new_group([0])

    def check(call):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            call()
        found = [str(w.message) for w in seen if "does not belong" in str(w.message)]
        if R != 0 and found != [text]:
            raise AssertionError(f"warn_not_in_group on rank {R}: {found}")
        return np.array([bool(found)])

    def jx():
        g = jaxpg.new_group([0])
        return check(lambda: jaxpg.all_reduce(np.ones(2, np.float32), group=g))

    def th():
        g = dist.new_group([0])
        return check(lambda: dist.all_reduce(torch.ones(2), group=g))
    return jx, th, want


# new_group's ranks for the non-member cases: every rank but the last
MEMBERS = list(range(W - 1))


@case
def non_member_rank_queries():
    """test_c10d_common's rank translations, asked on every rank of a group that leaves out
    the last rank: the non-member (GroupMember.NON_GROUP_MEMBER) answers as the members."""
    members = MEMBERS
    want = np.array([*members, 0, len(members) - 1, members[-1], R in members])

    def ask(mod, g):
        return np.array([*mod.get_process_group_ranks(g), mod.get_group_rank(g, 0),
                         mod.get_group_rank(g, members[-1]),
                         mod.get_global_rank(g, len(members) - 1),
                         g is not mod.GroupMember.NON_GROUP_MEMBER])

    def jx():
        return ask(jaxpg, jaxpg.new_group(members))

    def th():
        return ask(dist, dist.new_group(members))
    return jx, th, want


@case
def non_member_keeps_its_tensors():
    """_test_warn_not_in_group's calls with data: a non-member's all_reduce, broadcast and
    all_gather leave its tensor as it was (jaxpg: the input comes back unchanged)."""
    members = MEMBERS
    x = np.full(2, R + 1, np.float32)
    if R in members:
        want = [np.full(2, sum(r + 1 for r in members), np.float32), np.full(2, 1, np.float32),
                np.stack([np.full(2, r + 1, np.float32) for r in members])]
    else:
        want = [x, x, x]

    def jx():
        g = jaxpg.new_group(members)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the non-member's warning: warn_not_in_group
            out = [jaxpg.all_reduce(x, group=g), jaxpg.broadcast(x, src=0, group=g)]
            gathered = jaxpg.all_gather(x, group=g)
        return out + [np.stack(gathered) if R in members else gathered]

    def th():
        g = dist.new_group(members)
        out = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for op in (lambda y: dist.all_reduce(y, group=g),
                       lambda y: dist.broadcast(y, src=0, group=g)):
                y = t(x.copy())
                if op(y) is not None:
                    raise AssertionError("torch's collective returned a value")
                out.append(y.numpy())
            y = t(x.copy())
            lst = [torch.zeros(2) for _ in members]
            dist.all_gather(lst, y, group=g)
        if R in members:
            return out + [torch.stack(lst).numpy()]
        if any(bool(v.any()) for v in lst):
            raise AssertionError("torch's all_gather wrote a non-member's tensor_list")
        return out + [y.numpy()]
    return jx, th, want


@case
def all_to_all_single_non_contiguous():
    """test_all_to_all_single's contiguity rule: torch raises for a non-contiguous input;
    JAX arrays have no strides, so jaxpg takes the same values (docs/collectives.md)."""
    base = np.arange(2 * W * 3, dtype=np.float32).reshape(2 * W, 3) + 100 * R
    view = np.asfortranarray(base)  # the same values, column-major: non-contiguous in torch
    want = np.concatenate([np.arange(2 * W * 3, dtype=np.float32).reshape(2 * W, 3)
                           [2 * R:2 * R + 2] + 100 * s for s in range(W)])

    def jx():
        return jaxpg.all_to_all_single(view)

    def th():
        strided = torch.from_numpy(base.T.copy()).T  # torch's own non-contiguous view
        out = torch.zeros(2 * W, 3)
        try:
            dist.all_to_all_single(out, strided)
        except (RuntimeError, ValueError) as err:
            if "contiguous" not in str(err):
                raise
        else:
            raise AssertionError("torch took a non-contiguous all_to_all_single input")
        dist.all_to_all_single(out, strided.contiguous())
        return out.numpy()
    return jx, th, want


# ------------------------------------------------------------------ collectives torch checks
@case
def all_reduce_ops():
    """test_allreduce_basics and the op variants: SUM, PRODUCT, MIN, MAX on R + 1."""
    x = np.arange(3, dtype=np.float32) + R + 1
    rows = [np.arange(3, dtype=np.float32) + r + 1 for r in range(W)]
    want = [np.sum(rows, 0), np.prod(rows, 0), np.min(rows, 0), np.max(rows, 0)]

    def jx():
        return [jaxpg.all_reduce(x, op=op) for op in (jaxpg.ReduceOp.SUM, jaxpg.ReduceOp.PRODUCT,
                                                      jaxpg.ReduceOp.MIN, jaxpg.ReduceOp.MAX)]

    def th():
        out = []
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN,
                   dist.ReduceOp.MAX):
            y = t(x.copy())
            dist.all_reduce(y, op=op)
            out.append(y.numpy())
        return out
    return jx, th, want


@case
def broadcast_every_root():
    """test_broadcast_basics: every rank as the root."""
    want = [np.full(2, 5 * root + 1, np.int32) for root in range(W)]

    def jx():
        return [jaxpg.broadcast(np.full(2, 5 * R + 1, np.int32), src=root) for root in range(W)]

    def th():
        out = []
        for root in range(W):
            y = torch.full((2,), 5 * R + 1, dtype=torch.int32)
            dist.broadcast(y, src=root)
            out.append(y.numpy())
        return out
    return jx, th, want


@case
def all_to_all_single_unequal_split():
    """test_all_to_all_single_unequal_split: rank r sends i + 1 rows to rank i."""
    inp = np.full((sum(i + 1 for i in range(W)), 2), R, np.float32)
    want = np.concatenate([np.full((R + 1, 2), s, np.float32) for s in range(W)])
    in_splits, out_splits = [i + 1 for i in range(W)], [R + 1] * W

    def jx():
        return jaxpg.all_to_all_single(inp, out_splits, in_splits)

    def th():
        out = torch.zeros(W * (R + 1), 2)
        dist.all_to_all_single(out, t(inp), out_splits, in_splits)
        return out.numpy()
    return jx, th, want


@case
def gather_and_scatter_every_root():
    """test_gather_basics / test_scatter_basics: every root."""
    want = []
    for root in range(W):
        want.append(np.stack([np.full(2, r, np.float32) for r in range(W)]) if R == root
                    else np.zeros((0, 2), np.float32))
        want.append(np.full(2, 3 * R + root, np.float32))

    def jx():
        out = []
        for root in range(W):
            g = jaxpg.gather(np.full(2, R, np.float32), dst=root)
            out.append(np.stack(g) if R == root else np.zeros((0, 2), np.float32))
            rows = [np.full(2, 3 * i + root, np.float32) for i in range(W)]
            out.append(jaxpg.scatter(np.zeros(2, np.float32), rows if R == root else None,
                                     src=root))
        return out

    def th():
        out = []
        for root in range(W):
            lst = [torch.zeros(2) for _ in range(W)] if R == root else None
            dist.gather(torch.full((2,), float(R)), lst, dst=root)
            out.append(torch.stack(lst).numpy() if R == root else np.zeros((0, 2), np.float32))
            y = torch.zeros(2)
            rows = [torch.full((2,), float(3 * i + root)) for i in range(W)]
            dist.scatter(y, rows if R == root else None, src=root)
            out.append(y.numpy())
        return out
    return jx, th, want


@case
def object_collectives():
    """test_c10d_object_collectives: all_gather_object, broadcast_object_list, gather_object."""
    want = np.array([sum(range(W)), W - 1, sum(range(W)) if R == 0 else -1])

    def jx():
        gathered = jaxpg.all_gather_object({"r": R})
        bcast = jaxpg.broadcast_object_list([{"r": R}], src=W - 1)
        got = jaxpg.gather_object({"r": R}, dst=0)
        return np.array([sum(o["r"] for o in gathered), bcast[0]["r"],
                         sum(o["r"] for o in got) if R == 0 else -1])

    def th():
        gathered = [None] * W
        dist.all_gather_object(gathered, {"r": R})
        bcast = [{"r": R}]
        dist.broadcast_object_list(bcast, src=W - 1)
        got = [None] * W if R == 0 else None
        dist.gather_object({"r": R}, got, dst=0)
        return np.array([sum(o["r"] for o in gathered), bcast[0]["r"],
                         sum(o["r"] for o in got) if R == 0 else -1])
    return jx, th, want


@case
def barrier_then_all_gather():
    """test_barrier: a barrier, then every rank's value everywhere."""
    want = [np.array([r], np.int32) for r in range(W)]

    def jx():
        jaxpg.barrier()
        return jaxpg.all_gather(np.array([R], np.int32))

    def th():
        dist.barrier()
        out = [torch.zeros(1, dtype=torch.int32) for _ in range(W)]
        dist.all_gather(out, torch.tensor([R], dtype=torch.int32))
        return [o.numpy() for o in out]
    return jx, th, want


for fn in CASES:
    jx, th, want = fn()
    try:
        same(fn.__name__, jx(), want)
    except BaseException:
        traceback.print_exc(file=sys.stdout)
        raise
    print(f"CHECK {fn.__name__} ok", flush=True)
    if dist is not None:
        same(fn.__name__ + " (torch)", th(), want)
        print(f"TORCH {fn.__name__} ok", flush=True)
jaxpg.barrier()
if dist is not None:
    dist.destroy_process_group()
print("DONE", flush=True)
