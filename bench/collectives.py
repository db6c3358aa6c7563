"""Collective benchmark: jaxpg's eager path against a hand-written ``shard_map`` kernel.

One process, 8 simulated CPU devices (``--xla_force_host_platform_device_count=8``, set
before JAX is imported). For each collective and message size it times, per call and
blocking on the result (``block_until_ready``):

* ``eager_sharded``: ``jaxpg.<collective>(x)`` with ``x`` an already-sharded ``[8, ...]``
  ``jax.Array`` (rank ``r``'s data in row ``r``, on device ``r``: the eager fast path);
* ``eager_host``: the same call with a host numpy ``[8, ...]`` array, so every call also
  transfers the data to the devices (numpy buffers are never cached by JAX, so passing the
  same numpy array each call is a fresh host input each call);
* ``handwritten``: ``jax.jit(jax.shard_map(lambda x: lax.<op>(x[0], axis)[None], ...))``
  doing the same ``lax`` op on the same already-sharded input (on each rank's block without
  its leading axis of 1, so gathers and scatters run along the major dimension, as in jaxpg).

Sizes follow nccl-tests: ``S`` is the per-rank buffer nccl-tests reports (the input for
all_reduce, broadcast, reduce_scatter and all_to_all; the output for all_gather, whose
per-rank input is ``S / n``). ``algbw = S / time``; ``busbw = algbw x`` 2(n-1)/n for
all_reduce, (n-1)/n for all_gather, reduce_scatter and all_to_all, 1 for broadcast.
jaxpg's broadcast lowers to a masked ``psum`` (what ``GroupLowering.broadcast`` does on a
native axis), and the hand-written kernel does the same.

The variants are timed in interleaved rounds (each round calls every variant once, in a
rotating order), so drift in machine load hits them alike; the reported time is the median
over rounds. On a small shared machine the numbers are noisy: read the medians, not single
calls. ``overhead = eager / handwritten - 1``.

Also measured at the smallest size: the host-side dispatch time (the time until the call
returns, before blocking), whose eager-minus-handwritten difference is the Python overhead
of the eager path without the noise of the collective itself.

Writes ``bench/results/collectives.json`` and ``bench/results/collectives.png`` (bus
bandwidth against size, eager against hand-written) and prints a markdown table.

    python bench/collectives.py                  # 1 KB .. 16 MB, about 3.5 minutes
    python bench/collectives.py --quick          # 1 KB .. 1 MB, about 30 s
    python bench/collectives.py --max-size 64M   # adds 64 MB: ~3 more minutes, few rounds

The default stops at 16 MB per rank: at 64 MB the 8 ranks' buffers are 512 MB each, and
on a small machine the three variants of five collectives then get too few rounds for a
median to mean much (docs/benchmarks.md gives the figures).
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _rounds import block, load_average, no_wait, run_rounds  # noqa: E402
from _sizes import fmt_size, parse_size  # noqa: E402  (bench/ is sys.path[0])
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpg  # noqa: E402

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_to_all_single", "broadcast")
VARIANTS = ("handwritten", "eager_sharded", "eager_host")
RESULTS = Path(__file__).parent / "results"


def bus_factor(name: str, n: int) -> float:
    """nccl-tests' busbw / algbw for a collective over ``n`` ranks."""
    if name == "all_reduce":
        return 2 * (n - 1) / n
    if name == "broadcast":
        return 1.0
    return (n - 1) / n


def make_case(name: str, size: int, n: int, mesh, axis: str, sharding):
    """Returns (host input, eager fn, hand-written kernel) for one collective and size."""
    elems = size // 4  # float32
    per_rank = elems // n if name == "all_gather_into_tensor" else elems
    host = np.random.default_rng(0).standard_normal((n, per_rank), dtype=np.float32)

    def smap(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(axis), out_specs=P(axis)))

    if name == "all_reduce":
        eager = jaxpg.all_reduce
        hand = smap(lambda x: lax.psum(x, axis))
    elif name == "all_gather_into_tensor":
        eager = jaxpg.all_gather_into_tensor
        hand = smap(lambda x: lax.all_gather(x[0], axis, tiled=True)[None])
    elif name == "reduce_scatter_tensor":
        eager = jaxpg.reduce_scatter_tensor
        hand = smap(lambda x: lax.psum_scatter(x[0], axis, tiled=True)[None])
    elif name == "all_to_all_single":
        eager = jaxpg.all_to_all_single
        hand = smap(lambda x: lax.all_to_all(x[0].reshape(n, -1), axis, 0, 0, tiled=True)
                    .reshape(1, -1))
    elif name == "broadcast":
        eager = lambda x: jaxpg.broadcast(x, src=0)  # noqa: E731
        hand = smap(lambda x: lax.psum(
            jnp.where(lax.axis_index(axis) == 0, x, jnp.zeros_like(x)), axis))
    else:
        raise ValueError(name)
    return host, eager, hand


def dispatch_times(fns: dict, reps: int) -> tuple[dict, dict]:
    """Median wall and calling-thread CPU seconds until each call returns (before
    blocking), interleaved. The CPU time leaves out the time the thread waits for a core,
    so it is the steadier measure of host-side cost on a loaded machine."""
    r = run_rounds(fns, reps, wait=no_wait, settle=block, cpu_clock=time.thread_time)
    return r.medians(), r.medians(cpu=True)


def check_same(name: str, a, b) -> None:
    a, b = np.asarray(a), np.asarray(b).reshape(np.shape(a))
    if not np.allclose(a, b, rtol=1e-5, atol=1e-5):
        raise AssertionError(f"{name}: eager and hand-written results differ")


def bench_one(name: str, size: int, n: int, mesh, axis: str, sharding, args,
              probe: bool) -> dict:
    """Times the three variants of one collective at one size; returns its result row."""
    host, eager, hand = make_case(name, size, n, mesh, axis, sharding)
    sharded = jax.device_put(host, sharding)
    fns = {
        "handwritten": lambda: hand(sharded),
        "eager_sharded": lambda: eager(sharded),
        "eager_host": lambda: eager(host),
    }
    t0 = time.perf_counter()
    outs = {k: jax.block_until_ready(f()) for k, f in fns.items()}  # compile
    compile_s = time.perf_counter() - t0
    check_same(name, outs["eager_sharded"], outs["handwritten"])
    check_same(name, outs["eager_host"], outs["handwritten"])
    del outs
    big = size >= (4 << 20)
    timed = run_rounds(fns, args.max_reps, warmup=1,  # one more warm call each
                       budget_s=args.budget_big if big else args.budget,
                       min_rounds=5 if big else args.min_reps)
    times, med = timed.wall, timed.medians()
    hw = med["handwritten"]
    algbw = {k: size / t / 1e9 for k, t in med.items()}
    row = {
        "collective": name, "size_bytes": size, "reps": len(times["handwritten"]),
        "median_us": {k: t * 1e6 for k, t in med.items()},
        "overhead_pct": {k: (med[k] / hw - 1) * 100 for k in ("eager_sharded", "eager_host")},
        "overhead_us": {k: (med[k] - hw) * 1e6 for k in ("eager_sharded", "eager_host")},
        "algbw_GBps": algbw,
        "busbw_GBps": {k: b * bus_factor(name, n) for k, b in algbw.items()},
        "compile_and_first_call_s": compile_s, **timed.loads(),
    }
    if probe:
        wall, cpu = dispatch_times(fns, args.dispatch_reps)
        row["dispatch_us"] = {k: v * 1e6 for k, v in wall.items()}
        row["dispatch_cpu_us"] = {k: v * 1e6 for k, v in cpu.items()}
    return row


def run(args) -> dict:
    jaxpg.init_process_group()
    pg = jaxpg.GroupMember.WORLD
    n = pg.size()
    mesh, axis = pg.family_mesh, pg.axis_name
    sharding = NamedSharding(mesh, P(axis))
    sizes = []
    s = parse_size(args.min_size)
    while s <= parse_size(args.max_size):
        sizes.append(s)
        s *= 4
    rows = []
    overhead_probe = {}
    t_start = time.perf_counter()
    load_before = load_average()
    for size in sizes:
        for name in COLLECTIVES:
            row = bench_one(name, size, n, mesh, axis, sharding, args,
                            probe=size == sizes[0])
            if "dispatch_us" in row:
                d, c = row["dispatch_us"], row["dispatch_cpu_us"]
                overhead_probe[name] = {
                    "eager_sharded_minus_handwritten_dispatch_us":
                        d["eager_sharded"] - d["handwritten"],
                    "eager_host_minus_handwritten_dispatch_us":
                        d["eager_host"] - d["handwritten"],
                    "eager_sharded_minus_handwritten_dispatch_cpu_us":
                        c["eager_sharded"] - c["handwritten"],
                    "eager_host_minus_handwritten_dispatch_cpu_us":
                        c["eager_host"] - c["handwritten"],
                }
            rows.append(row)
            m = row["median_us"]
            print(f"  {fmt_size(size):>4} {name:24s} hw {m['handwritten']:10.1f} us  eager "
                  f"{m['eager_sharded']:10.1f} us "
                  f"({row['overhead_pct']['eager_sharded']:+6.1f}%)  host "
                  f"{m['eager_host']:10.1f} us  [{row['reps']} rounds, "
                  f"{time.perf_counter() - t_start:5.1f} s]", flush=True)
    return {
        "benchmark": "collectives",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "jax": jax.__version__, "devices": n, "device_kind": "simulated CPU"},
        "method": ("median of interleaved rounds of blocking calls; float32 data; sizes and "
                   "busbw as nccl-tests (S = per-rank buffer; all_gather input is S/n)"),
        "quick": args.quick,
        "sizes_bytes": sizes,
        "rows": rows,
        "small_size_dispatch_overhead": overhead_probe,
        "wall_s": time.perf_counter() - t_start,
        "load_average_before": load_before, "load_average_after": load_average(),
    }


def summarize(result: dict) -> dict:
    rows = result["rows"]
    smallest = min(result["sizes_bytes"])
    big = [r for r in rows if r["size_bytes"] >= (1 << 20)]
    small = [r for r in rows if r["size_bytes"] == smallest]
    return {
        "max_overhead_pct_at_ge_1MB": max((r["overhead_pct"]["eager_sharded"] for r in big),
                                          default=None),
        "median_overhead_pct_at_ge_1MB": (statistics.median(
            r["overhead_pct"]["eager_sharded"] for r in big) if big else None),
        "overhead_us_at_smallest": {r["collective"]: r["overhead_us"]["eager_sharded"]
                                    for r in small},
        "dispatch_overhead_us_at_smallest": {
            k: v["eager_sharded_minus_handwritten_dispatch_us"]
            for k, v in result["small_size_dispatch_overhead"].items()},
        "dispatch_cpu_overhead_us_at_smallest": {
            k: v["eager_sharded_minus_handwritten_dispatch_cpu_us"]
            for k, v in result["small_size_dispatch_overhead"].items()},
        "targets": "eager_sharded <= 10% over handwritten at >= 1 MB; <= 50 us per call at 1 KB",
        "target_10pct_met_by_median": (statistics.median(
            r["overhead_pct"]["eager_sharded"] for r in big) <= 10) if big else None,
        "target_10pct_met_by_every_cell": (all(
            r["overhead_pct"]["eager_sharded"] <= 10 for r in big)) if big else None,
        "target_50us_met": all(r["overhead_us"]["eager_sharded"] <= 50 for r in small),
    }


def table(result: dict) -> str:
    lines = [
        "| size | collective | eager us (sharded) | eager us (host numpy) | handwritten us "
        "| overhead % (sharded) | overhead % (host) | busbw GB/s eager | busbw GB/s hw |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        m, o, b = r["median_us"], r["overhead_pct"], r["busbw_GBps"]
        lines.append(
            f"| {fmt_size(r['size_bytes'])} | {r['collective']} | {m['eager_sharded']:.1f} | "
            f"{m['eager_host']:.1f} | {m['handwritten']:.1f} | {o['eager_sharded']:+.1f} | "
            f"{o['eager_host']:+.1f} | {b['eager_sharded']:.3f} | {b['handwritten']:.3f} |"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(COLLECTIVES), figsize=(4 * len(COLLECTIVES), 3.6),
                             sharey=True)
    for ax, name in zip(axes, COLLECTIVES):
        rows = [r for r in result["rows"] if r["collective"] == name]
        x = [r["size_bytes"] for r in rows]
        for key, style, label in (("handwritten", "k-o", "hand-written shard_map"),
                                  ("eager_sharded", "C0-s", "jaxpg eager (sharded in)"),
                                  ("eager_host", "C1--^", "jaxpg eager (numpy in)")):
            ax.plot(x, [r["busbw_GBps"][key] for r in rows], style, label=label, ms=4)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("message size per rank (bytes)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("bus bandwidth (GB/s)")
    axes[0].legend(fontsize=7)
    fig.suptitle("jaxpg collectives, 8 simulated CPU devices (median of interleaved rounds; "
                 "noisy shared 2-core host)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1 KB .. 1 MB, short budgets (~30 s)")
    p.add_argument("--min-size", default="1K")
    p.add_argument("--max-size", default="16M",
                   help="largest size (64M works, but each call then takes 0.5-1.5 s here)")
    p.add_argument("--budget", type=float, default=2.0,
                   help="seconds of interleaved rounds per (size, collective)")
    p.add_argument("--budget-big", type=float, default=8.0,
                   help="the same, for sizes of 4 MB and more")
    p.add_argument("--min-reps", type=int, default=15)
    p.add_argument("--max-reps", type=int, default=400)
    p.add_argument("--dispatch-reps", type=int, default=300)
    p.add_argument("--out", default=str(RESULTS / "collectives"),
                   help="path stem for the .json and .png results")
    args = p.parse_args()
    if args.quick:
        args.max_size = "1M" if args.max_size == "16M" else args.max_size
        args.budget, args.min_reps, args.max_reps, args.dispatch_reps = 0.6, 7, 200, 100
        args.budget_big = 1.0
    result = run(args)
    result["summary"] = summarize(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print()
    print(table(result))
    print()
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
