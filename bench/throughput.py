"""CPU multi-process throughput: jaxpg against torch gloo, each in the same processes.

For each N (``--nprocs``) and each worker placement (``slice``: jaxpg-run's default, every
CPU worker pinned to its slice of the CPUs; ``none``: ``JAXPG_CPU_AFFINITY=none``,
``OMP_NUM_THREADS`` = cores / N, unpinned), round by round in a rotating order:

* ``bench/collectives_mp.py`` at 16 MB, all_reduce only: jaxpg's eager all_reduce, torch
  gloo's and XLA's jitted psum in the same processes (busbw, median over its rounds);
* ``bench/_throughput_ddp_worker.py``: torch DDP and jaxpg DDP on the 25M-parameter MLP in
  the same processes, plus the local compute alone and a 100 MB all-reduce alone (the
  overlap figure).

Ratios are taken inside one launch (same processes, interleaved), then the median over
rounds is reported. The machine is 2 cores shared with other jobs: read ratios, not
absolute figures.

    python bench/throughput.py                         # N = 2, 3 rounds, ~10 min
    python bench/throughput.py --nprocs 2,4 --rounds 2

Writes ``bench/results/throughput.json`` (``--configuration NAME``: as that named
configuration inside it, e.g. ``n8``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from _launch import BENCH, RESULTS, child_env, free_port, launch  # bench/ is sys.path[0]
from _results import add_flag, save
from _rounds import load_average, rotated

PLACEMENTS = ("slice", "none", "nocombine", "hugetlb", "nohuge")
NO_COMBINER = "--xla_disable_hlo_passes=cpu-all-reduce-combiner"


def env_for(placement: str, n: int) -> dict[str, str | None]:
    """The environment overrides of a placement (for ``bench/_launch.py``): ``slice``:
    jaxpg-run's defaults; ``none``: unpinned; ``nocombine``: pinned, with XLA:CPU's
    all-reduce combiner off (so each DDP bucket stays its own all-reduce); ``hugetlb`` /
    ``nohuge``: pinned, the glibc tunables with / without ``glibc.malloc.hugetlb=1``
    (transparent huge pages for malloc'd memory), set explicitly whatever jaxpg-run's
    default is."""
    env: dict[str, str | None] = {"JAXPG_CPU_AFFINITY": None, "OMP_NUM_THREADS": None}
    if placement == "none":
        env["JAXPG_CPU_AFFINITY"] = "none"
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
    if placement in ("hugetlb", "nohuge"):
        env["GLIBC_TUNABLES"] = ("glibc.malloc.mmap_threshold=33554432:"
                                 "glibc.malloc.trim_threshold=1073741824")
        if placement == "hugetlb":
            env["GLIBC_TUNABLES"] += ":glibc.malloc.hugetlb=1"
    if placement == "nocombine":
        env["XLA_FLAGS"] = (child_env().get("XLA_FLAGS", "") + " " + NO_COMBINER).strip()
    return env


def run_allreduce(n: int, placement: str, rounds: int, tmp: str) -> dict:
    out = os.path.join(tmp, f"ar_{n}_{placement}.json")
    # collectives_mp.py is a driver (one plain process) that launches the N workers
    launch(BENCH / "collectives_mp.py", ["--nprocs", n, "--min-size", "16M", "--max-size",
                                         "16M", "--ops", "all_reduce", "--no-breakdown",
                                         "--rounds", rounds, "--out", out],
           env=env_for(placement, n), timeout=600, expect=[out])
    row = json.loads(Path(out).read_text())["rows"][0]
    b = row["busbw_GBps"]
    return {"busbw_GBps": b, "jaxpg_over_torch": b["jaxpg"] / b["torch"],
            "xla_over_torch": b["xla"] / b["torch"]}


def run_ddp(n: int, placement: str, steps: int, tmp: str, only: str) -> dict:
    out = os.path.join(tmp, f"ddp_{n}_{placement}.json")
    wargs = ["--torch-port", free_port(), "--steps", steps, "--warmup", "2", "--out", out]
    launch(BENCH / "_throughput_ddp_worker.py", wargs + (["--only", only] if only else []),
           nproc=n, env=env_for(placement, n), timeout=900, expect=[out],
           what=f"DDP N={n} {placement}")
    return json.loads(Path(out).read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nprocs", default="2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ar-rounds", type=int, default=5, help="rounds inside collectives_mp")
    p.add_argument("--ddp-steps", type=int, default=6)
    p.add_argument("--placements", default="slice,none", help=f"some of {PLACEMENTS}")
    p.add_argument("--skip-ddp", action="store_true")
    p.add_argument("--ddp-only", default="", help="subset of the DDP worker's variants")
    p.add_argument("--out", default=str(RESULTS / "throughput.json"))
    add_flag(p)
    args = p.parse_args()
    placements = args.placements.split(",")
    ns = [int(x) for x in args.nprocs.split(",")]
    runs: dict[str, dict[str, list]] = {}
    t0 = time.perf_counter()
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for n in ns:
                for pl in rotated(placements, r):
                    key = f"{n}/{pl}"
                    runs.setdefault(key, {"allreduce": [], "ddp": []})
                    ar = run_allreduce(n, pl, args.ar_rounds, tmp)
                    runs[key]["allreduce"].append(ar)
                    msg = (f"round {r} N={n} {pl:5s} all_reduce 16MB jaxpg/torch "
                           f"{ar['jaxpg_over_torch']:.2f}x xla/torch {ar['xla_over_torch']:.2f}x")
                    if not args.skip_ddp:
                        d = run_ddp(n, pl, args.ddp_steps, tmp, args.ddp_only)
                        runs[key]["ddp"].append(d)
                        msg += (f" | DDP jaxpg/torch {d['jaxpg_over_torch_samples']:.2f}x "
                                + " ".join(f"{k}={v:.0f}ms" for k, v in d["step_ms"].items()))
                    print(msg, flush=True)
    summary = {}
    for key, rs in runs.items():
        ar = rs["allreduce"]
        s = {
            "allreduce_16MB_busbw_jaxpg_over_torch": statistics.median(
                x["jaxpg_over_torch"] for x in ar),
            "allreduce_16MB_busbw_xla_over_torch": statistics.median(
                x["xla_over_torch"] for x in ar),
            "allreduce_16MB_busbw_GBps": {v: statistics.median(x["busbw_GBps"][v] for x in ar)
                                          for v in ("jaxpg", "torch", "xla")},
        }
        if rs["ddp"]:
            d = rs["ddp"]
            s["ddp_step_ms"] = {v: statistics.median(x["step_ms"][v] for x in d)
                                for v in d[0]["step_ms"]}
            s["ddp_samples_per_s"] = {v: statistics.median(x["samples_per_s"][v] for x in d)
                                      for v in d[0]["samples_per_s"]}
            s["ddp_over_torch_samples"] = {
                v: statistics.median(x["over_torch_samples"][v] for x in d)
                for v in d[0]["over_torch_samples"]}
            s["ddp_samples_jaxpg_over_torch"] = s["ddp_over_torch_samples"]["jaxpg"]
            for k in d[0]:
                if k.startswith("overlap_"):
                    s[k] = statistics.median(x[k] for x in d)
            if "attribution_ms" in d[0]:
                s["attribution_ms"] = {k: statistics.median(x["attribution_ms"][k] for x in d)
                                       for k in d[0]["attribution_ms"]}
        summary[key] = s
    result = {
        "benchmark": "bench/throughput.py",
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before,
                    "loadavg_after": load_average(),
                    "shared": "2 cores shared with other tests and benchmarks",
                    "device_machine": "none: 16-core figures not measured"},
        "rounds": args.rounds, "ddp_only": args.ddp_only, "summary": summary, "runs": runs,
        "wall_s": time.perf_counter() - t0,
    }
    save(args.out, result, args.configuration)
    print("\n| N | workers | all_reduce 16 MB busbw, jaxpg / torch | XLA psum / torch "
          "| DDP samples/s over torch, per variant |")
    print("|---|---|---|---|---|")
    for key, s in summary.items():
        n, pl = key.split("/")
        ddp = " ".join(f"{v}={r:.2f}x" for v, r in s.get("ddp_over_torch_samples", {}).items())
        print(f"| {n} | {pl} | {s['allreduce_16MB_busbw_jaxpg_over_torch']:.2f}x "
              f"| {s['allreduce_16MB_busbw_xla_over_torch']:.2f}x | {ddp} |")
        if "attribution_ms" in s:
            print("   attribution ms:", {k: round(v) for k, v in s["attribution_ms"].items()},
                  " step ms:", {k: round(v) for k, v in s["ddp_step_ms"].items()})
    print(f"\nwrote {args.out} in {time.perf_counter() - t0:.0f} s")


# python -m bench throughput --quick: a short run, written under /tmp unless --out is given
QUICK_ARGS = ["--rounds", "1"]

if __name__ == "__main__":
    main()
