"""One worker of ``bench/collectives_mp.py`` (started by ``jaxpg.run``; not run by hand).

Every worker joins two worlds at once: jaxpg's (``jaxpg.init_process_group()``, gloo
through XLA) and torch.distributed's (gloo, ``tcp://127.0.0.1:<port>``, the same rank).
For each size and collective it times, in the same processes and interleaved round by
round (the order rotates each round):

* ``jaxpg``: the eager call (``jaxpg.all_reduce(x)`` ...) on this rank's ``jax.Array``;
* ``torch``: the torch.distributed call on this rank's ``torch.Tensor``;
* ``xla``: the "XLA floor", a jitted ``shard_map`` of the matching ``lax`` collective over
  ``jax.devices()`` on an input that is already a global array (no host work per call).

A round times ``iters`` back-to-back calls after a torch barrier; each rank measures its
own time per call, and the result is the slowest rank's, then the median over rounds.
Rank 0 writes everything as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.distributed as dist
from _rounds import block, medians
from _timing import join_both_worlds, leave_both_worlds, slowest_rank, time_rounds
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpg

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")


def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("broadcast", "send_recv"):
        return 1.0
    return (n - 1) / n


def make_case(op: str, size: int, rank: int, n: int, mesh: Mesh) -> dict:
    """Returns {variant: zero-argument callable} for one op at per-rank size ``size``."""
    elems = size // 4
    in_elems = elems // n if op == "all_gather" else elems
    host = np.full(in_elems, rank + 1, np.float32)
    dev = jax.local_devices()[0]
    jx = jax.device_put(host, dev)
    th = torch.from_numpy(host.copy())
    sharding = NamedSharding(mesh, P("i"))
    glob = jax.make_array_from_process_local_data(sharding, host, (n * in_elems,))

    def smap(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("i"), out_specs=P("i")))

    peer = rank + 1 if rank % 2 == 0 else rank - 1
    if op == "all_reduce":
        fj = lambda: jaxpg.all_reduce(jx)  # noqa: E731
        ft = lambda: dist.all_reduce(th)  # noqa: E731
        k = smap(lambda x: lax.psum(x, "i"))
    elif op == "all_gather":
        out_t = torch.empty(elems, dtype=torch.float32)
        fj = lambda: jaxpg.all_gather_into_tensor(jx)  # noqa: E731
        ft = lambda: dist.all_gather_into_tensor(out_t, th)  # noqa: E731
        k = smap(lambda x: lax.all_gather(x, "i", tiled=True))
    elif op == "reduce_scatter":
        out_t = torch.empty(elems // n, dtype=torch.float32)
        fj = lambda: jaxpg.reduce_scatter_tensor(jx)  # noqa: E731
        ft = lambda: dist.reduce_scatter_tensor(out_t, th)  # noqa: E731
        k = smap(lambda x: lax.psum_scatter(x, "i", tiled=True))
    elif op == "all_to_all":
        out_t = torch.empty(elems, dtype=torch.float32)
        fj = lambda: jaxpg.all_to_all_single(jx)  # noqa: E731
        ft = lambda: dist.all_to_all_single(out_t, th)  # noqa: E731
        k = smap(lambda x: lax.all_to_all(x.reshape(n, -1), "i", 0, 0, tiled=True)
                 .reshape(-1))
    elif op == "broadcast":
        fj = lambda: jaxpg.broadcast(jx, src=0)  # noqa: E731
        ft = lambda: dist.broadcast(th, src=0)  # noqa: E731
        # what jaxpg's lowering (and a JAX user) writes: a masked psum
        k = smap(lambda x: lax.psum(jnp.where(lax.axis_index("i") == 0, x, 0.0), "i"))
    elif op == "send_recv":
        # pairs (0 -> 1), (2 -> 3): every pair moves S bytes at once; torch's semantics
        # (the receiver passes a buffer), so jaxpg sends no metadata header (meta=False)
        if rank % 2 == 0:
            fj = lambda: jaxpg.send(jx, peer, meta=False)  # noqa: E731
            ft = lambda: dist.send(th, peer)  # noqa: E731
        else:
            fj = lambda: jaxpg.recv(jx, peer, meta=False)  # noqa: E731
            ft = lambda: dist.recv(th, peer)  # noqa: E731
        pairs = [(a, a + 1) for a in range(0, n - 1, 2)]
        k = smap(lambda x: lax.ppermute(x, "i", pairs))
    else:
        raise ValueError(op)
    fx = lambda: k(glob)  # noqa: E731
    return {"jaxpg": fj, "torch": ft, "xla": fx}


def iters_for(size: int, budget_bytes: int) -> int:
    return max(1, min(50, budget_bytes // size))


def breakdown(size: int, rank: int, n: int, mesh: Mesh, reps: int) -> dict:
    """Where an eager all_reduce's time goes, piece by piece (medians of ``reps``, this rank).

    The three whole calls run after a barrier each; the pieces run on their own.
    """
    from jaxpg.groups import multiprocess

    pg = jaxpg.GroupMember.WORLD
    elems = size // 4
    host = np.full(elems, rank + 1, np.float32)
    x = jax.device_put(host, jax.local_devices()[0])
    th = torch.from_numpy(host.copy())
    sharding = NamedSharding(mesh, P("i"))
    g1 = jax.make_array_from_process_local_data(sharding, host, (n * elems,))
    psum = jax.jit(jax.shard_map(lambda a: lax.psum(a, "i"), mesh=mesh, in_specs=P("i"),
                                 out_specs=P("i")))
    stacked_sh = NamedSharding(pg.family_mesh, P(pg.axis_name))
    gs = jax.make_array_from_process_local_data(stacked_sh, host[None], (n, elems))
    counter = iter(range(10**9))
    pieces = {
        "jaxpg all_reduce": lambda: jaxpg.all_reduce(x),
        "torch all_reduce": lambda: dist.all_reduce(th),
        "XLA psum (floor)": lambda: psum(g1),
        "in, flat: make_array_from_single_device_arrays": lambda: (
            jax.make_array_from_single_device_arrays((n * elems,), sharding, [x])),
        "out, flat: addressable_shards[0].data": lambda: g1.addressable_shards[0].data,
        "in, stacked (before): x[None] copy": lambda: x[None],
        "in, stacked (before): make_array_from_process_local_data": lambda: (
            jax.make_array_from_process_local_data(stacked_sh, np.asarray(x)[None],
                                                   (n, elems))),
        "out, stacked (before): shard.data[0] copy": lambda: gs.addressable_shards[0].data[0],
        "arrival RPC, synchronous (before): store.add": lambda: pg.store.add(
            f"bench_arrive/{next(counter)}", 1),
        "worker-thread handoff (run_collective)": lambda: (
            multiprocess.submit(lambda: None, "noop").result()),
    }
    res = {}
    for name, f in pieces.items():
        collective = name.split()[0] in ("jaxpg", "torch", "XLA")
        block(f())
        ts = []
        for _ in range(reps):
            if collective:
                dist.barrier()
            t0 = time.perf_counter()
            block(f())
            ts.append(time.perf_counter() - t0)
        res[name] = statistics.median(ts) * 1e6
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", required=True, help="comma-separated bytes per rank")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iter-bytes", type=int, default=16 << 20,
                   help="a round does about this many bytes per rank (1 to 50 calls)")
    p.add_argument("--torch-port", type=int, required=True)
    p.add_argument("--breakdown-sizes", default="")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    rank, n = join_both_worlds(args.torch_port)
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices), ("i",))
    sizes = [int(s) for s in args.sizes.split(",")]
    ops = args.ops.split(",")
    rows = []
    t_start = time.perf_counter()
    for size in sizes:
        for op in ops:
            if op == "send_recv" and n % 2:
                continue
            fns = make_case(op, size, rank, n, mesh)
            t0 = time.perf_counter()
            for f in fns.values():  # compile and warm up
                dist.barrier()
                block(f())
                block(f())
            warm_s = time.perf_counter() - t0
            iters = iters_for(size, args.iter_bytes)
            times = time_rounds(fns, args.rounds, iters)
            del fns
            per_round = slowest_rank(times)
            if rank == 0:
                med = medians(per_round)
                row = {"n": n, "op": op, "size_bytes": size, "iters": iters,
                       "rounds": args.rounds, "warmup_s": warm_s,
                       "time_us": {v: t * 1e6 for v, t in med.items()},
                       "round_times_us": {v: [t * 1e6 for t in ts]
                                          for v, ts in per_round.items()},
                       "algbw_GBps": {v: size / t / 1e9 for v, t in med.items()},
                       "busbw_GBps": {v: size / t / 1e9 * bus_factor(op, n)
                                      for v, t in med.items()}, **times.loads()}
                rows.append(row)
                print(f"N={n} {op:15s} {size:>10d} B  " + "  ".join(
                    f"{v}={t * 1e6:10.1f}us" for v, t in med.items()), flush=True)
    bd = {}
    for s in [int(s) for s in args.breakdown_sizes.split(",") if s]:
        r = breakdown(s, rank, n, mesh, reps=max(5, min(30, (64 << 20) // s)))
        allr = [None] * n
        dist.all_gather_object(allr, r)
        if rank == 0:
            bd[str(s)] = {k: statistics.median(x[k] for x in allr) for k in r}
            print(f"breakdown N={n} {s} B: " + ", ".join(
                f"{k}={v:.0f}us" for k, v in bd[str(s)].items()), flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"n": n, "rows": rows, "breakdown_us": bd, "jaxpg_file": jaxpg.__file__,
                       "elapsed_s": time.perf_counter() - t_start,
                       "cpu_collectives": jax.config.jax_cpu_collectives_implementation},
                      f, indent=1)
    leave_both_worlds()
    os._exit(0)


if __name__ == "__main__":
    main()
