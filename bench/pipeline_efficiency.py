"""Pipeline step time against the bound, with the pipeline ranks really in parallel.

``p`` processes (``jaxpg-run --nproc-per-node p``), each pinned by the launcher to its own
CPU core (so XLA:CPU runs one intra-op thread per rank) with one CPU device, the
pipeline's ``ppermute`` over gloo between them. The baseline is the same model's
un-pipelined step (``jax.value_and_grad`` of the whole model on the whole batch) on ONE
device pinned to ONE core (rank 0's, while the other ranks wait). Per round, the baseline
and every (schedule, m) run once each in a rotating order, in the same processes; with
``T1`` the round's baseline and ``T`` the pipelined step,

    ideal = T1 (m + p - 1) / (m p),    efficiency = ideal / T,

(``jaxpg.pipeline.schedule.costs.ideal_step_time``),

and the table gives the median over rounds. ``rank CPU / wall`` (the ranks' summed
process CPU time over p x wall time) says how much of its core each rank used: above
1 / p it cannot be one core's work; far below 1 the ranks waited, in the bubble or for a
core the machine's other jobs held. ``CPU / baseline CPU`` (the ranks' summed CPU time
over the baseline's) is the work the pipeline did for the same model and batch: 1 is no
overhead, whatever the load. The ``microbatched`` row runs the un-pipelined model one
microbatch at a time (``lax.scan``) on one core: the part of that overhead that comes
from the smaller matmuls alone.

Before timing, each schedule's gradients are checked against the un-pipelined step and
against the same pipeline run in one process on ``p`` simulated devices (at the smallest
m). Model: ``--blocks`` residual MLP blocks ``x + W2 gelu(W1 x + b1) + b2`` (width
``--dim``, hidden ``4 dim``), mean squared error, ``--microbatch`` rows per microbatch,
``remat=False`` (the default).

    python bench/pipeline_efficiency.py [--nproc 2] [--ms 4,8,16] [--rounds 7]

Writes ``bench/results/pipeline_efficiency.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

import _pipeline_mp  # before JAX (through _pipeline_mp_worker): sets the device flags
from _launch import RESULTS
from _pipeline_mp_worker import CHUNKS
from _rounds import load_average, ratio_median

from jaxpg.pipeline.schedule.costs import ideal_step_time


def efficiency_rows(raw: dict, schedules: list[str], ms: list[int]) -> list[dict]:
    times, p = raw["times"], raw["p"]
    rows = []
    for m in ms:
        base = times[f"baseline m={m}"]
        t1 = base["wall_s"]
        t1_cpu = [c[0] for c in base["cpu_s_per_rank"]]
        rows.append({"schedule": "un-pipelined, 1 device, 1 core", "m": m,
                     "step_ms": 1e3 * statistics.median(t1),
                     "cpu_ms": 1e3 * statistics.median(t1_cpu)})  # fmt: skip
        mb = times.get(f"baseline_microbatched m={m}")
        if mb:
            mb_cpu = [c[0] for c in mb["cpu_s_per_rank"]]
            rows.append({
                "schedule": "un-pipelined, microbatched (lax.scan), 1 core", "m": m,
                "step_ms": mb["median_ms"], "cpu_ms": 1e3 * statistics.median(mb_cpu),
                "cpu_over_baseline_cpu": ratio_median(mb_cpu, t1_cpu),
            })  # fmt: skip
        for name in schedules:
            rec = times[f"jaxpg {name} m={m}"]
            ideal = [ideal_step_time(a, p, m) for a in t1]
            use = [sum(c) / (p * w) for c, w in zip(rec["cpu_s_per_rank"], rec["wall_s"],
                                                    strict=True)]  # fmt: skip
            rows.append({
                "schedule": name, "m": m, "step_ms": rec["median_ms"],
                "ideal_ms": 1e3 * statistics.median(ideal),
                "efficiency": ratio_median(ideal, rec["wall_s"]),
                "rank_cpu_over_wall": statistics.median(use),
                "cpu_over_baseline_cpu": statistics.median(
                    sum(c) / b for c, b in zip(rec["cpu_s_per_rank"], t1_cpu, strict=True)),
            })  # fmt: skip
    return rows


def table(rows: list[dict], p: int) -> str:
    lines = [f"| schedule (p = {p}) | m | step ms | ideal ms | efficiency | rank CPU / wall "
             "| CPU / baseline CPU |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        if "efficiency" not in r:
            ratio = r.get("cpu_over_baseline_cpu")
            ratio = f"{ratio:.2f} " if ratio else ""
            lines.append(f"| {r['schedule']} | {r['m']} | {r['step_ms']:.0f} | - | - | - "
                         f"| {ratio}(CPU {r['cpu_ms']:.0f} ms) |")  # fmt: skip
            continue
        lines.append(f"| {r['schedule']} | {r['m']} | {r['step_ms']:.0f} | {r['ideal_ms']:.0f} "
                     f"| {r['efficiency']:.2f} | {r['rank_cpu_over_wall']:.2f} "
                     f"| {r['cpu_over_baseline_cpu']:.2f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="pipeline ranks p (processes)")
    ap.add_argument("--schedules", default=",".join(CHUNKS))
    ap.add_argument("--ms", default="4,8,16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--microbatch", type=int, default=64)
    ap.add_argument("--out", default=str(RESULTS / "pipeline_efficiency.json"))
    ap.add_argument(
        "--retabulate",
        action="store_true",
        help="only rebuild the rows and table of --out from its raw times",
    )
    args = ap.parse_args()
    if args.retabulate:
        result = json.loads(Path(args.out).read_text())
        config = result["config"]
        result["rows"] = efficiency_rows(result["raw"], args.schedules.split(","), config["ms"])
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(table(result["rows"], config["p"]))
        return
    if args.nproc > 4:
        raise SystemExit(f"--nproc={args.nproc}: at most 4 (the reference's simulated devices)")
    schedules = [s for s in args.schedules.split(",") if s]
    ms = [int(v) for v in args.ms.split(",")]
    model = ["--blocks", str(args.blocks), "--dim", str(args.dim),
             "--microbatch", str(args.microbatch)]  # fmt: skip
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        ref = os.path.join(tmp, "reference.npz")
        _pipeline_mp.single_process_reference(ref, schedules, args.nproc, min(ms), args.blocks,
                                              args.dim, args.microbatch)  # fmt: skip
        raw_path = os.path.join(tmp, "raw.json")
        _pipeline_mp.launch(args.nproc, [
            "--baseline", "--schedules", ",".join(schedules), "--ms", args.ms,
            "--rounds", str(args.rounds), "--reference", ref, "--out", raw_path, *model,
        ])  # fmt: skip
        raw = json.loads(Path(raw_path).read_text())
    oversubscribed = args.nproc > (os.cpu_count() or 1)
    result = {
        "config": {
            "p": args.nproc, "blocks": args.blocks, "dim": args.dim, "hidden": 4 * args.dim,
            "microbatch_rows": args.microbatch, "ms": ms, "rounds": args.rounds,
            "remat": False, "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "layout": "one process per pipeline rank under jaxpg-run, each pinned to its "
                      "own core, one CPU device, gloo ppermute between processes; baseline "
                      "un-pipelined on one device pinned to one core",
            "oversubscribed": oversubscribed,
            "note": "2-core machine shared with other jobs; efficiency is a per-round ratio",
            "load_average_before": load_before, "load_average_after": load_average(),
        },
        "rows": efficiency_rows(raw, schedules, ms),
        "raw": raw,
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(raw["checks"], indent=1))
    if oversubscribed:
        print(f"OVERSUBSCRIBED: {args.nproc} ranks on {os.cpu_count()} cores")
    print(table(result["rows"], args.nproc))
    print(f"written to {args.out}")


# python -m bench pipeline_efficiency --quick: a short run, written under /tmp unless --out is given
QUICK_ARGS = ["--rounds", "1"]

if __name__ == "__main__":
    main()
