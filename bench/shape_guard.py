"""What a default cross-rank shape check would cost on the eager path.

Without ``JAXPG_DEBUG=DETAIL``, ranks that pass different shapes to one collective reach
XLA's gloo with different byte counts: one rank aborts in C++, or (seen with 3 floats
against 2) the collective *completes* on a rank with wrong numbers. DETAIL prevents it
with a store round trip per call. The candidate measured here needs no store: the
collective's kernel first all-gathers one int32 per rank, a hash of its (op, shapes,
dtypes), and runs the collective under ``lax.cond`` only if every rank's hash is the same;
else every rank skips it and the host raises. Both programs agree on the first
collective (an int32 all-gather of the group's size), so a mismatch cannot abort.

Variants, timed in the same two processes (``jaxpg-run --nproc-per-node 2``), in rounds
that rotate their order (``bench/_rounds.py``), each call blocking on its result:

* ``plain``: ``jit(shard_map(psum))`` on a global array (XLA alone);
* ``guarded``: the same with the hash all-gather and the ``cond`` in front;
* ``eager``: ``jaxpg.all_reduce`` as a user calls it (the eager path's host work too).

``--check-mismatch`` runs the guard with different shapes on the two ranks and prints what
each rank saw (the guard must skip on both, and nothing may abort).

    flock /tmp/jaxpg-bench.lock python bench/shape_guard.py     # ~2 minutes
    python bench/shape_guard.py --check-mismatch

Writes ``bench/results/shape_guard.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the shared helpers
from _launch import RESULTS, launch  # noqa: E402
from _rounds import diff_median, ratio_median, run_rounds  # noqa: E402

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
            "plain": lambda plain=plain, x=x: plain(x),
            "guarded": lambda guarded=guarded, x=x: guarded(x)[0],
            "eager": lambda local=local: jaxpg.all_reduce(local),
        }
        # two warm-up calls each (compile); every sample after a barrier
        timed = run_rounds(variants, args.rounds, iters=iters, warmup=2,
                           barrier=jaxpg.barrier)
        times = {k: [t * 1e3 for t in v] for k, v in timed.wall.items()}
        ratios = [g / p for g, p in zip(times["guarded"], times["plain"])]
        results[label] = {
            "ms_per_call_median": {k: v * 1e3 for k, v in timed.medians().items()},
            "guarded_over_plain_median": ratio_median(times["guarded"], times["plain"]),
            "guarded_over_plain_range": [min(ratios), max(ratios)],
            "guarded_minus_plain_ms_median": diff_median(times["guarded"], times["plain"]),
            "iters_per_round": iters, **timed.loads(),
        }
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    jaxpg.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS / "shape_guard.json"))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--check-mismatch", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    part = Path(args.out).with_suffix(".part.json")
    # the mismatch check prints what each rank saw, whatever the exit: check=False there
    done = launch(__file__, ["--worker", "--out", part, "--rounds", args.rounds]
                  + (["--check-mismatch"] if args.check_mismatch else []), nproc=2,
                  timeout=900, check=not args.check_mismatch)
    print((done.output or "")[-4000:])
    if args.check_mismatch:
        sys.exit(done.returncode)
    results = json.loads(part.read_text())
    part.unlink()
    record = {"command": "python bench/shape_guard.py --rounds " + str(args.rounds),
              "processes": 2, "machine": "shared 2-core CPU VM (jaxpg development machine)",
              "results": results}
    Path(args.out).write_text(json.dumps(record, indent=2))
    print("| size | plain ms | guarded ms | jaxpg.all_reduce ms | guarded / plain (range) |")
    print("|---|---:|---:|---:|---:|")
    for label, r in results.items():
        ms = r["ms_per_call_median"]
        lo, hi = r["guarded_over_plain_range"]
        print(f"| {label} | {ms['plain']:.3f} | {ms['guarded']:.3f} | {ms['eager']:.3f} | "
              f"{r['guarded_over_plain_median']:.2f}x ({lo:.2f}-{hi:.2f}) |")


# python -m bench shape_guard --quick: a short run, written under /tmp unless --out is given
QUICK_ARGS = ["--rounds", "3"]

if __name__ == "__main__":
    main()
