"""Multi-process collectives: jaxpg's eager path against torch.distributed (gloo) and XLA.

For N = 2 and 4 processes on this machine (``jaxpg.run``, one CPU device each, gloo under
XLA), ``bench/_collectives_mp_worker.py`` times, *in the same processes and interleaved
round by round* (each round calls every variant, in a rotating order, after a barrier):

* ``jaxpg``: the eager call on this rank's ``jax.Array``: ``all_reduce``,
  ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single`` (even
  splits), ``broadcast`` (src 0), and ``send``/``recv`` (pairs 0->1, 2->3, ``meta=False``
  with the receiver passing a buffer, as torch's recv);
* ``torch``: the same call in torch.distributed 2.x on gloo (the same ranks, a second
  rendezvous on ``tcp://127.0.0.1``), on a CPU ``torch.Tensor``;
* ``xla``: the "XLA floor": a jitted ``shard_map`` of the matching ``lax`` collective
  (``psum``, ``all_gather``, ``psum_scatter``, ``all_to_all``, a masked ``psum`` for
  broadcast, ``ppermute`` for send/recv) over ``jax.devices()`` on an array that is
  already global: what the eager path costs with no host work at all.

Every call blocks on its result. A round times 1 to 50 back-to-back calls (about 16 MB
per rank); the time of a round is the slowest rank's; the reported time is the median
over rounds. Sizes follow nccl-tests: ``S`` is the per-rank buffer (the input, except
all_gather's output; all_gather's per-rank input is S / N). ``algbw = S / time``;
``busbw = algbw x`` 2(N-1)/N for all_reduce, (N-1)/N for all_gather, reduce_scatter and
all_to_all, 1 for broadcast and send/recv. jaxpg's broadcast is a masked psum, so it moves
2(N-1)/N x S per rank where gloo's broadcast moves S: expect it below torch.

Also measured (unless ``--no-breakdown``): the pieces of one eager all_reduce at 4 KB,
1 MB and 16 MB, each timed alone: the input and output conversions (today's copy-free
ones and the stacked ones jaxpg used before), the arrival RPC that every collective made
before, and the worker-thread hand-off.

The machine is small and shared (2 cores under other jobs' load): numbers are noisy,
medians over rounds are what to read, and N = 4 runs 4 processes on 2 cores.

Writes ``bench/results/collectives_mp.json`` and ``.png``, and prints a markdown table::

    python bench/collectives_mp.py            # N = 2, 4; 4 KB .. 64 MB; about 6-8 minutes
    python bench/collectives_mp.py --quick    # 4 KB, 64 KB, 1 MB, 16 MB; 3 rounds; ~3 min
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from _launch import BENCH, RESULTS, free_port, launch  # bench/ is sys.path[0]
from _rounds import load_average
from _sizes import fmt_size, parse_size

WORKER = BENCH / "_collectives_mp_worker.py"
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
API = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor",
       "reduce_scatter": "reduce_scatter_tensor", "all_to_all": "all_to_all_single",
       "broadcast": "broadcast", "send_recv": "send/recv"}


NOTES = [
    "2 CPU cores shared with other jobs: N=4 puts 4 processes (plus gloo and XLA threads) "
    "on 2 cores; read medians, and compare columns of one row (measured interleaved), not "
    "rows of different runs.",
    "XLA's gloo all_reduce and all_gather (the XLA floor and jaxpg alike) can stall at about "
    "20 ms per call at 16 KB-256 KB after a mix of smaller collectives (reproduce: the worker "
    "with --sizes 4096,16384 --ops all_reduce,all_gather,reduce_scatter,all_to_all); "
    "torch's gloo in the same processes does not; run alone they take about 1 ms.",
    "jaxpg's broadcast is a masked psum (2(N-1)/N x S per rank, the ring all-reduce), torch's "
    "moves S; all_to_all_single across processes exchanges split sizes and slices and "
    "concatenates on the host (jaxpg/collectives/all_to_all.py) before the one kernel.",
]


def sizes_between(lo: int, hi: int, step: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= step
    return out


def run_n(n: int, sizes: list[int], args: argparse.Namespace, breakdown: list[int]) -> dict:
    """Starts N workers through jaxpg.run; returns rank 0's JSON."""

    def progress(line: str) -> None:  # rank 0's progress lines
        if line.startswith("[rank 0] N=") or line.startswith("[rank 0] breakdown"):
            print(line[9:], flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"n{n}.json"
        done = launch(WORKER, ["--sizes", ",".join(map(str, sizes)), "--ops", ",".join(args.ops),
                               "--rounds", args.rounds, "--torch-port", free_port(),
                               "--breakdown-sizes", ",".join(map(str, breakdown)),
                               "--out", out],
                      nproc=n, timeout=args.timeout, echo=progress, expect=[out], what=f"N={n}")
        res = json.loads(out.read_text())
        res["wall_s"] = done.seconds
        return res


def table(rows: list[dict]) -> str:
    head = ("| N | size | op | jaxpg busbw GB/s | torch busbw GB/s | XLA floor busbw GB/s "
            "| jaxpg / torch | time per call us (jaxpg / torch / XLA) |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        b, t = r["busbw_GBps"], r["time_us"]
        lines.append(
            f"| {r['n']} | {fmt_size(r['size_bytes'])} | {API[r['op']]} | {b['jaxpg']:.3f} | "
            f"{b['torch']:.3f} | {b['xla']:.3f} | {b['jaxpg'] / b['torch']:.2f}x | "
            f"{t['jaxpg']:.0f} / {t['torch']:.0f} / {t['xla']:.0f} |")
    return "\n".join(lines)


def targets(rows: list[dict]) -> dict:
    """The goals: all_reduce busbw >= 1.0x torch at >= 1 MB; small-message
    (the smallest size) latency within 1.5x of torch's."""
    out = {}
    for n in sorted({r["n"] for r in rows}):
        ar = [r for r in rows if r["n"] == n and r["op"] == "all_reduce"]
        big = {fmt_size(r["size_bytes"]): r["busbw_GBps"]["jaxpg"] / r["busbw_GBps"]["torch"]
               for r in ar if r["size_bytes"] >= 1 << 20}
        small = min(ar, key=lambda r: r["size_bytes"]) if ar else None
        lat = {}
        for r in rows:
            if r["n"] == n and small is not None and r["size_bytes"] == small["size_bytes"]:
                lat[r["op"]] = r["time_us"]["jaxpg"] / r["time_us"]["torch"]
        out[str(n)] = {
            "all_reduce_busbw_ratio_ge_1MB": big,
            "all_reduce_busbw_target_met": bool(big) and min(big.values()) >= 1.0,
            "small_size": small["size_bytes"] if small else None,
            "small_latency_ratio_by_op": lat,
            "all_reduce_small_latency_target_met": bool(lat) and lat.get("all_reduce", 9) <= 1.5,
            "xla_floor_over_torch_all_reduce_busbw_ge_1MB": {
                fmt_size(r["size_bytes"]): r["busbw_GBps"]["xla"] / r["busbw_GBps"]["torch"]
                for r in ar if r["size_bytes"] >= 1 << 20},
        }
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted({r["n"] for r in rows})
    ops = [o for o in OPS if any(r["op"] == o for r in rows)]
    fig, axes = plt.subplots(len(ns), len(ops), figsize=(3.2 * len(ops), 3.0 * len(ns)),
                             squeeze=False, sharex=True)
    style = {"jaxpg": ("tab:blue", "o-"), "torch": ("tab:orange", "s--"),
             "xla": ("tab:green", "^:")}
    label = {"jaxpg": "jaxpg eager", "torch": "torch gloo", "xla": "XLA floor (jit psum..)"}
    for i, n in enumerate(ns):
        for j, op in enumerate(ops):
            ax = axes[i][j]
            rs = sorted((r for r in rows if r["n"] == n and r["op"] == op),
                        key=lambda r: r["size_bytes"])
            xs = [r["size_bytes"] for r in rs]
            for v, (color, fmt) in style.items():
                ax.plot(xs, [r["busbw_GBps"][v] for r in rs], fmt, color=color, label=label[v],
                        ms=3)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{API[op]}, N={n}", fontsize=9)
            ax.tick_params(labelsize=7)
            if j == 0:
                ax.set_ylabel("bus bandwidth (GB/s)", fontsize=8)
            if i == len(ns) - 1:
                ax.set_xlabel("bytes per rank", fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("jaxpg eager vs torch.distributed gloo vs XLA floor, CPU, one process per "
                 "rank (2 shared cores; medians)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4 sizes, 3 rounds")
    p.add_argument("--nprocs", default="2,4")
    p.add_argument("--min-size", default="4K")
    p.add_argument("--max-size", default="64M")
    p.add_argument("--max-size-n4", default="64M", help="cap for N >= 4 (time and memory)")
    p.add_argument("--step", type=int, default=4, help="size multiplier between points")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--no-breakdown", action="store_true")
    p.add_argument("--timeout", type=float, default=600, help="seconds per N")
    p.add_argument("--out", default=str(RESULTS / "collectives_mp.json"))
    args = p.parse_args()
    args.ops = [o for o in args.ops.split(",") if o]
    if args.quick:
        sizes = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
        args.rounds = min(args.rounds, 3)
        bd = [4 << 10, 1 << 20]
    else:
        sizes = sizes_between(parse_size(args.min_size), parse_size(args.max_size), args.step)
        bd = [4 << 10, 1 << 20, 16 << 20]
    if args.no_breakdown:
        bd = []
    t0 = time.perf_counter()
    load_before = load_average()
    runs = {}
    for n in [int(x) for x in args.nprocs.split(",")]:
        cap = parse_size(args.max_size_n4) if n >= 4 else 1 << 62
        runs[str(n)] = run_n(n, [s for s in sizes if s <= cap], args, bd)
    rows = [r for n in runs for r in runs[n]["rows"]]
    import jax
    import torch

    result = {
        "benchmark": "bench/collectives_mp.py",
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "jax": jax.__version__,
                    "torch": torch.__version__,
                    "loadavg_before": load_before, "loadavg_after": load_average()},
        "method": ("same processes, variants interleaved per round in rotating order, each "
                   "round after a barrier, every call blocking; a round's time is the slowest "
                   "rank's; median over rounds. busbw per nccl-tests."),
        "rounds": args.rounds, "sizes": sizes, "quick": args.quick,
        "targets": targets(rows),
        "breakdown_us": {n: runs[n].get("breakdown_us", {}) for n in runs},
        "jaxpg_file": {n: runs[n].get("jaxpg_file") for n in runs},
        "notes": NOTES,
        "wall_s": {n: runs[n]["wall_s"] for n in runs},
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(rows, out.with_suffix(".png"))
    print()
    print(table(rows))
    print()
    for n, t in result["targets"].items():
        print(f"N={n}: all_reduce busbw jaxpg/torch at >= 1 MB: "
              + ", ".join(f"{k} {v:.2f}x" for k, v in t["all_reduce_busbw_ratio_ge_1MB"].items())
              + f" (target >= 1.0: {'met' if t['all_reduce_busbw_target_met'] else 'NOT met'})")
        print(f"N={n}: time per call jaxpg/torch at {fmt_size(t['small_size'])}: "
              + ", ".join(f"{API[k]} {v:.2f}x" for k, v in t["small_latency_ratio_by_op"].items())
              + " (target all_reduce <= 1.5: "
              + f"{'met' if t['all_reduce_small_latency_target_met'] else 'NOT met'})")
    for n, bd_n in result["breakdown_us"].items():
        for size, pieces in bd_n.items():
            print(f"\nbreakdown, N={n}, {fmt_size(int(size))} (median us, each piece alone):")
            for k, v in pieces.items():
                print(f"  {k:58s} {v:10.0f}")
    print(f"\nwrote {out} and {out.with_suffix('.png')} in {time.perf_counter() - t0:.0f} s "
          f"(load average before {load_before[0]:.1f}, after {load_average()[0]:.1f})")


if __name__ == "__main__":
    main()
