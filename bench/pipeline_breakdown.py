"""Where a pipeline step's time goes, per tick and per rank: compute, transfer, waiting.

Three setups, each on the comparison's model by default (``--blocks 4`` residual MLP blocks of
width 512, ``--m 8`` microbatches of ``--microbatch 32`` rows, no optimizer):

* ``2proc``: 2 processes under ``jaxpg-run``, one rank each, each pinned to its own core;
* ``4proc``: 4 processes, one rank each, two to a core (the launcher's round-robin);
* ``1proc``: 4 simulated devices in one process (the SPMD executor only).

For the lockstep executor (``executor="spmd"``) a profiler trace of one step gives, per
tick and rank, the *compute* (from the end of the previous tick's ``ppermute`` to the
start of this one's) and the ``ppermute``'s time, split into the *transfer* (the fastest
rank's ``ppermute``: the last to arrive waits for no one) and the rank's *waiting* (the
rest: for the slowest rank of the tick), out of one traced step (its wall time is given
too: tracing slows it). For the process executor (``executor="mpmd"``)
``jaxpg.pipeline.process.step_timeline`` gives per rank the compute, the idle time (step minus
compute), the host's waits for messages and the lanes' transfer time (which overlaps
compute). Step times are medians of ``--steps`` untraced steps.

    python bench/pipeline_breakdown.py [--setups 2proc,4proc,1proc]

Writes ``bench/results/pipeline_breakdown.json`` and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench/: the shared helpers
import _pipeline_mp  # noqa: E402  (before JAX: the reference's device flag)
from _launch import RESULTS, launch  # noqa: E402
from _rounds import load_average  # noqa: E402

WORKER = HERE / "_pipeline_breakdown_worker.py"


def lockstep_rows(setup: str, name: str, rec: dict) -> list[dict]:
    """Per rank totals of the lockstep executor from the per-tick traces."""
    per_rank = {}  # rank label -> ticks
    for rank, data in sorted(rec["ranks"].items()):
        for _tid, ticks in sorted(data["spmd"]["ticks"].items()):  # one process: by device
            label = rank if len(rec["ranks"]) > 1 else f"device {_tid}"
            per_rank[label] = ticks
    n = rec["ticks"]
    moving = [min(t[i]["transfer"] for t in per_rank.values()) for i in range(n)]
    rows = []
    for label, ticks in per_rank.items():
        mine = rec["ranks"][label if len(rec["ranks"]) > 1 else next(iter(rec["ranks"]))]
        step, traced = mine["spmd"]["step_s"], mine["spmd"]["traced_step_s"]
        compute = sum(t["compute"] for t in ticks)
        transfer = sum(moving)
        wait = sum(t["transfer"] for t in ticks) - transfer
        rows.append({"setup": setup, "schedule": name, "executor": "lockstep (spmd)",
                     "rank": label, "step_ms": 1e3 * step, "compute_ms": 1e3 * compute,
                     "transfer_ms": 1e3 * transfer, "wait_ms": 1e3 * wait,
                     "traced_step_ms": 1e3 * traced,
                     "outside_loop_ms": 1e3 * (traced - compute - transfer - wait),
                     "tick_ms": [round(1e3 * (t["compute"] + t["transfer"]), 2)
                                 for t in ticks],
                     "tick_compute_ms": [round(1e3 * t["compute"], 2) for t in ticks]})
    return rows


def mpmd_rows(setup: str, name: str, rec: dict) -> list[dict]:
    rows = []
    for rank, data in sorted(rec["ranks"].items()):
        if "mpmd" not in data:
            continue
        tl = data["mpmd"]["timeline"]
        rows.append({"setup": setup, "schedule": name, "executor": "process (mpmd)",
                     "rank": rank, "step_ms": 1e3 * data["mpmd"]["step_s"],
                     "compute_ms": 1e3 * tl["compute"], "idle_ms": 1e3 * tl["idle"],
                     "host_wait_ms": 1e3 * tl["host_wait"],
                     "lane_transfer_ms": 1e3 * tl["transfer"],
                     "traced_step_ms": 1e3 * tl["wall"]})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| setup | schedule | executor | rank | step ms | compute ms | transfer ms "
             "| waiting ms | other |", "|---|---|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if "wait_ms" in r:
            other = (f"traced step {r['traced_step_ms']:.0f} ms, of which outside the tick "
                     f"loop {r['outside_loop_ms']:.0f} ms")
            transfer, wait = r["transfer_ms"], r["wait_ms"]
        else:
            other = (f"idle {r['idle_ms']:.0f} ms (host waited {r['host_wait_ms']:.0f} ms for "
                     f"messages); traced step {r['traced_step_ms']:.0f} ms")
            transfer, wait = r["lane_transfer_ms"], None
        lines.append(
            f"| {r['setup']} | {r['schedule']} | {r['executor']} | {r['rank']} "
            f"| {r['step_ms']:.0f} | {r['compute_ms']:.0f} | {transfer:.1f} "
            f"| {'-' if wait is None else f'{wait:.0f}'} | {other} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setups", default="2proc,4proc,1proc")
    ap.add_argument("--schedules", default="1f1b,zb_h1")
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--microbatch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "pipeline_breakdown.json"))
    args = ap.parse_args()
    common = ["--schedules", args.schedules, "--m", str(args.m), "--blocks", str(args.blocks),
              "--dim", str(args.dim), "--microbatch", str(args.microbatch),
              "--steps", str(args.steps)]  # fmt: skip
    raw, rows = {}, []
    loads, load_before = [os.getloadavg()[0]], load_average()
    with tempfile.TemporaryDirectory() as tmp:
        for setup in args.setups.split(","):
            out = os.path.join(tmp, f"{setup}.json")
            if setup == "1proc":  # one plain process; it sets its own device flag
                launch(WORKER, ["--one-process", "4", *common, "--out", out],
                       env={"XLA_FLAGS": None}, timeout=3000, capture=False)
            else:
                nproc = int(setup.removesuffix("proc"))
                _pipeline_mp.launch(nproc, [*common, "--out", out], worker=WORKER)
            raw[setup] = json.loads(Path(out).read_text())
            loads.append(os.getloadavg()[0])
            for name, rec in raw[setup]["schedules"].items():
                rows += lockstep_rows(setup, name, rec) + mpmd_rows(setup, name, rec)
    result = {
        "config": {"blocks": args.blocks, "dim": args.dim, "hidden": 4 * args.dim,
                   "microbatch_rows": args.microbatch, "m": args.m, "steps": args.steps,
                   "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "load_1min": loads, "load_average_before": load_before,
        "load_average_after": load_average(), "rows": rows, "raw": raw,
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows))
    print(f"load average (1 min) during the run: {[round(v, 1) for v in loads]}")
    print(f"written to {args.out}")


# python -m bench pipeline_breakdown --quick: a short run, written under /tmp unless --out is given
QUICK_ARGS = ["--steps", "1"]

if __name__ == "__main__":
    main()
