"""Runs every collective across processes and checks it against numpy.

Every rank's input is a function of its rank, so each process can compute the numpy
reference over all ranks by itself. Prints ``CHECK <name> ok`` per check; any mismatch
raises (and the launcher then exits non-zero).
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpg


def data(r: int, shape=(3,), dtype=np.float32) -> np.ndarray:
    return (np.arange(np.prod(shape)).reshape(shape) + 10 * r + 1).astype(dtype)


def local(pg, fn):
    """This process's input for its ranks of pg: plain for one rank, stacked for several."""
    rows = [fn(r) for r in pg.local_members()]
    return rows[0] if len(rows) == 1 else np.stack(rows)


def per_rank(pg, out):
    """Splits this process's output into {global rank: array}."""
    mine = pg.local_members()
    out = np.asarray(jax.device_get(out))
    return {mine[0]: out} if len(mine) == 1 else {r: out[i] for i, r in enumerate(mine)}


def check(name: str, cond: bool) -> None:
    if not cond:
        raise AssertionError(f"{name} failed on process {jax.process_index()}")
    print(f"CHECK {name} ok", flush=True)


def close(a, b) -> bool:
    """Equal shapes and values (``np.allclose`` alone broadcasts: a wrong shape could pass)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a.shape == b.shape and np.allclose(a, b, rtol=1e-6)


def run_all() -> None:
    world = jaxpg.GroupMember.WORLD
    n = jaxpg.get_world_size()
    ranks = list(range(n))

    got = per_rank(world, jaxpg.all_reduce(local(world, data)))
    check("all_reduce_sum", all(close(v, sum(data(r) for r in ranks)) for v in got.values()))
    got = per_rank(world, jaxpg.all_reduce(local(world, lambda r: data(r, dtype=np.int32) % 7),
                                           op=jaxpg.ReduceOp.BXOR))
    want = np.bitwise_xor.reduce([data(r, dtype=np.int32) % 7 for r in ranks])
    check("all_reduce_bxor", all((v == want).all() for v in got.values()))

    sub = jaxpg.new_group([0, n - 1])
    if sub is not jaxpg.GroupMember.NON_GROUP_MEMBER:
        got = per_rank(sub, jaxpg.all_reduce(local(sub, data), op=jaxpg.ReduceOp.MAX, group=sub))
        check("subgroup_all_reduce", all(close(v, data(n - 1)) for v in got.values()))
    else:
        print("CHECK subgroup_all_reduce ok (not a member)", flush=True)

    parts = jaxpg.all_gather(local(world, data))
    ok = all(close(per_rank(world, parts[i])[r], data(i))
             for i in ranks for r in world.local_members())
    check("all_gather", ok)

    uneven = tuple(np.full((r + 1, 2), r, np.float32) for r in world.local_members())
    parts = jaxpg.all_gather(uneven if len(uneven) > 1 else uneven[0])
    shapes_ok = all(np.asarray(parts[i]).shape[-2] == i + 1 for i in ranks)
    check("all_gather_uneven", shapes_ok and all(
        np.all(np.asarray(parts[i]) == i) for i in ranks))

    got = per_rank(world, jaxpg.all_gather_into_tensor(local(world, data)))
    check("all_gather_into_tensor", all(close(v, np.concatenate([data(r) for r in ranks]))
                                        for v in got.values()))

    got = per_rank(world, jaxpg.reduce_scatter_tensor(local(world, lambda r: data(r, (n * 2,)))))
    full = sum(data(r, (n * 2,)) for r in ranks)
    check("reduce_scatter_tensor", all(close(v, full[2 * r: 2 * r + 2]) for r, v in got.items()))

    got = per_rank(world, jaxpg.broadcast(local(world, data), src=n - 1))
    check("broadcast", all(close(v, data(n - 1)) for v in got.values()))

    # async_op: a Work at once (queued on the runner), from a device array in every layout
    x = jax.device_put(local(world, data))
    works = [jaxpg.all_reduce(x, async_op=True), jaxpg.broadcast(x, src=n - 1, async_op=True)]
    got_sum, got_b = (per_rank(world, w.result()) for w in works)
    check("async_op", all(close(v, sum(data(r) for r in ranks)) for v in got_sum.values())
          and all(close(v, data(n - 1)) for v in got_b.values()))

    got = per_rank(world, jaxpg.reduce(local(world, data), dst=0))
    check("reduce", all(close(v, sum(data(r) for r in ranks) if r == 0 else data(r))
                        for r, v in got.items()))

    gathered = jaxpg.gather(local(world, data), dst=0)
    if 0 in world.local_members():
        check("gather", all(close(gathered[i], data(i)) for i in ranks))
    else:
        check("gather", gathered is None)

    holds_src = 1 in world.local_members()
    sl = [np.full(2, 100 + i, np.float32) for i in ranks] if holds_src else None
    tmpl = local(world, lambda r: np.zeros(2, np.float32))
    got = per_rank(world, jaxpg.scatter(tmpl, scatter_list=sl, src=1))
    check("scatter", all(close(v, np.full(2, 100 + r)) for r, v in got.items()))

    if len(world.local_members()) == 1:
        me = world.local_members()[0]
        chunks = [np.full((me + i + 1, 1), 10 * me + i, np.float32) for i in ranks]
        out = jaxpg.all_to_all(chunks)
        check("all_to_all_uneven", all(
            np.asarray(out[j]).shape == (j + me + 1, 1) and np.all(np.asarray(out[j]) ==
                                                                   10 * j + me)
            for j in ranks))
        splits = [me + i + 1 for i in ranks]
        x = np.concatenate([np.full(s, 10 * me + i, np.float32) for i, s in enumerate(splits)])
        out = np.asarray(jaxpg.all_to_all_single(x, input_split_sizes=splits))
        want = np.concatenate([np.full(j + me + 1, 10 * j + me, np.float32) for j in ranks])
        check("all_to_all_single_uneven", out.shape == want.shape and (out == want).all())

        even = np.asarray(jaxpg.all_to_all_single(np.arange(2 * n, dtype=np.float32) + 100 * me))
        want = np.concatenate([np.arange(2 * me, 2 * me + 2, dtype=np.float32) + 100 * j
                               for j in ranks])
        check("all_to_all_single_even", (even == want).all())

        # point-to-point with unknown shapes: one tensor, then several
        if me == 0:
            jaxpg.send(jnp.arange(6.0).reshape(2, 3), dst=n - 1)
            jaxpg.send([jnp.ones(4, jnp.int32), jnp.zeros((1, 2), jnp.bfloat16)], dst=n - 1)
        if me == n - 1:
            one = jaxpg.recv(src=0)
            several = jaxpg.recv(src=0)
            check("recv_unknown_shape", one.shape == (2, 3) and float(one.sum()) == 15.0)
            check("recv_several", [a.shape for a in several] == [(4,), (1, 2)]
                  and several[1].dtype == jnp.bfloat16)
        works = jaxpg.batch_isend_irecv([
            jaxpg.P2POp(jaxpg.isend, jnp.full(2, float(me)), (me + 1) % n),
            jaxpg.P2POp(jaxpg.irecv, None, (me - 1) % n),
        ])
        for w in works:
            w.wait()
        check("batch_isend_irecv_ring", close(works[1].result(), np.full(2, (me - 1) % n)))
    else:
        print("CHECK all_to_all_multi_rank_process", flush=True)
        out = jaxpg.all_to_all([local(world, lambda r, i=i: np.full(2, 10 * r + i, np.float32))
                                for i in ranks])
        ok = all(close(per_rank(world, out[j])[r], np.full(2, 10 * j + r))
                 for j in ranks for r in world.local_members())
        check("all_to_all_stacked", ok)

    objs = jaxpg.all_gather_object(jaxpg.PerRank([{"rank": r} for r in world.local_members()])
                                   if len(world.local_members()) > 1 else
                                   {"rank": world.local_members()[0]})
    check("all_gather_object", [o["rank"] for o in objs] == ranks)
    bl = jaxpg.broadcast_object_list(["a", 1, None] if 0 in world.local_members() else [0, 0, 0],
                                     src=0)
    check("broadcast_object_list", bl == ["a", 1, None])
    so = jaxpg.scatter_object_list([f"x{i}" for i in ranks] if 0 in world.local_members()
                                   else None, src=0)
    mine = so if isinstance(so, list) else [so]
    check("scatter_object_list", mine == [f"x{r}" for r in world.local_members()])

    # SPMD lowering across processes: a global array over the world's mesh
    sharding = NamedSharding(world.mesh, P(world.axis_name))
    rows = np.stack([data(r) for r in world.local_members()])
    x = jax.make_array_from_process_local_data(sharding, rows, (n, 3))
    f = jax.jit(jaxpg.spmd(lambda v: jaxpg.all_reduce(v) + jaxpg.get_rank()))
    out = f(x)
    total = sum(data(r) for r in ranks)
    ok = all(close(np.asarray(s.data)[0], total + world.ranks[s.index[0].start])
             for s in out.addressable_shards)
    check("spmd_all_reduce", ok)

    jaxpg.barrier()
    jaxpg.monitored_barrier(wait_all_ranks=True)
    check("barriers", True)


def main() -> None:
    init_method = sys.argv[1] if len(sys.argv) > 1 else None
    jaxpg.init_process_group(init_method=init_method)
    run_all()
    jaxpg.destroy_process_group()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
