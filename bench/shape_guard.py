"""What a default cross-rank shape check would cost on the eager path (issue 24, item 2).

Without ``JAXPG_DEBUG=DETAIL``, ranks that pass different shapes to one collective reach
XLA's gloo with different byte counts: one rank aborts in C++, or (seen with 3 floats
against 2) the collective *completes* on a rank with wrong numbers. DETAIL prevents it
with a store round trip per call. The candidate measured here needs no store: the
collective's kernel first all-gathers one int32 per rank, a hash of its (op, shapes,
dtypes), and runs the collective under ``lax.cond`` only if every rank's hash is the same;
else every rank skips it and the host raises. Both programs agree on the first
collective (an int32 all-gather of the group's size), so a mismatch cannot abort.

Variants, timed in the same two processes (``jaxpg-run --nproc-per-node 2``), in rounds
that alternate their order, each call blocking on its result:

* ``plain``: ``jit(shard_map(psum))`` on a global array (XLA alone);
* ``guarded``: the same with the hash all-gather and the ``cond`` in front;
* ``eager``: ``jaxpg.all_reduce`` as a user calls it (the eager path's host work too).

``--check-mismatch`` runs the guard with different shapes on the two ranks and prints what
each rank saw (the guard must skip on both, and nothing may abort).

    flock /tmp/jaxpg-bench.lock python bench/shape_guard.py            # about 2 minutes
    python bench/shape_guard.py --check-mismatch

Writes ``bench/results/shape_guard.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SIZES = {"4 KB": 1024, "4 MB": 1 << 20}


def _kernels(mesh, n_floats: int):
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    def plain_body(x):
        return lax.psum(x, "i")

    fingerprint = zlib.crc32(f"all_reduce float32[{n_floats}] SUM".encode()) & 0x7FFFFFFF

    def guarded_body(x):
        mine = jnp.full((1,), fingerprint, jnp.int32)
        every = lax.all_gather(mine, "i", tiled=True)
        same = jnp.all(every == every[0])
        out = lax.cond(same, lambda v: lax.psum(v, "i"), lambda v: jnp.zeros_like(v), x)
        return out, same[None]

    plain = jax.jit(jax.shard_map(plain_body, mesh=mesh, in_specs=P("i"), out_specs=P("i"),
                                  check_vma=False))
    guarded = jax.jit(jax.shard_map(guarded_body, mesh=mesh, in_specs=P("i"),
                                    out_specs=(P("i"), P("i")), check_vma=False))
    return plain, guarded


def worker(args: argparse.Namespace) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxpg

    jaxpg.init_process_group()
    rank, n = jaxpg.get_rank(), jaxpg.get_world_size()
    mesh = Mesh(np.array(jax.devices()), ("i",))
    sharding = NamedSharding(mesh, P("i"))

    def global_array(local: np.ndarray):
        block = jax.device_put(local, jax.local_devices()[0])
        return jax.make_array_from_single_device_arrays((n * local.shape[0],), sharding,
                                                        [block])

    if args.check_mismatch:
        size = 1000 if rank == 0 else 10
        _, guarded = _kernels(mesh, size)
        # each rank compiles for its own size: the programs differ, as with a user's bug
        local = np.ones(size, np.float32)
        try:
            x = global_array(local)
        except Exception as err:  # noqa: BLE001 (global shapes must agree: report it)
            print(f"rank {rank}: cannot even build the global array: {err}", flush=True)
            return
        out, same = guarded(x)
        print(f"rank {rank}: all shapes the same: {bool(np.asarray(same.addressable_data(0))[0])}",
              flush=True)
        return
    results = {}
    for label, size in SIZES.items():
        plain, guarded = _kernels(mesh, size)
        local = np.ones(size, np.float32)
        x = global_array(local)
        iters = 40 if size < 10_000 else 4
        variants = {
            "plain": lambda plain=plain, x=x: plain(x).block_until_ready(),
            "guarded": lambda guarded=guarded, x=x: guarded(x)[0].block_until_ready(),
            "eager": lambda local=local: jaxpg.all_reduce(local).block_until_ready(),
        }
        for fn in variants.values():  # compile and warm up
            fn()
            fn()
        times = {k: [] for k in variants}
        names = list(variants)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                jaxpg.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    variants[name]()
                times[name].append((time.perf_counter() - start) / iters * 1e3)
        ratios = [g / p for g, p in zip(times["guarded"], times["plain"])]
        results[label] = {
            "ms_per_call_median": {k: statistics.median(v) for k, v in times.items()},
            "guarded_over_plain_median": statistics.median(ratios),
            "guarded_over_plain_range": [min(ratios), max(ratios)],
            "guarded_minus_plain_ms_median": statistics.median(
                [g - p for g, p in zip(times["guarded"], times["plain"])]),
            "iters_per_round": iters,
        }
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    jaxpg.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS / ".shape_guard_rank0.json"))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--check-mismatch", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", "2", __file__, "--worker",
           "--out", args.out, "--rounds", str(args.rounds)]
    if args.check_mismatch:
        cmd.append("--check-mismatch")
    load_before = os.getloadavg()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    print(proc.stdout[-4000:], proc.stderr[-4000:] if proc.returncode else "")
    if args.check_mismatch or proc.returncode:
        sys.exit(proc.returncode)
    results = json.loads(Path(args.out).read_text())
    Path(args.out).unlink()
    record = {"command": "python bench/shape_guard.py --rounds " + str(args.rounds),
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "processes": 2, "machine": "shared 2-core CPU VM (jaxpg development machine)",
              "results": results}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "shape_guard.json").write_text(json.dumps(record, indent=2))
    print("| size | plain ms | guarded ms | jaxpg.all_reduce ms | guarded / plain (range) |")
    print("|---|---:|---:|---:|---:|")
    for label, r in results.items():
        ms = r["ms_per_call_median"]
        lo, hi = r["guarded_over_plain_range"]
        print(f"| {label} | {ms['plain']:.3f} | {ms['guarded']:.3f} | {ms['eager']:.3f} | "
              f"{r['guarded_over_plain_median']:.2f}x ({lo:.2f}-{hi:.2f}) |")


if __name__ == "__main__":
    main()
