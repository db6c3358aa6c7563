"""FSDP benchmark: step time and per-rank memory at N = 2 and 4 CPU processes, jaxpg's
FullyShardedDataParallel (stages 1-3) against jaxpg's DDP and torch FSDP2.

Each N is one launch of ``bench/_fsdp_worker.py`` under ``jaxpg-run`` (one rank per
process, gloo for both jaxpg and torch), in which every variant trains the same residual
MLP (512 -> 4 blocks of 512 -> 2048 -> 512 -> 10, 8.9M parameters, Adam) from the same
weights on the same data, one step per variant per round in a rotating order. Reported:
the slowest rank's median step time, and one rank's bytes of parameters + gradients +
optimizer state (and, for jaxpg, XLA's peak of the compiled step). Ratios are taken
inside one launch. The machine is 2 cores shared with other work: read ratios.

    flock /tmp/jaxpg-bench.lock python bench/fsdp.py          # about 5 minutes
    python bench/fsdp.py --nprocs 2 --rounds 3                # quicker

Writes ``bench/results/fsdp.json`` and prints a markdown table. Goals: step
time at least torch FSDP2's (``torch / jaxpg >= 1``) and stage-3 state at most 0.6x
DDP's at N = 2 and 0.35x at N = 4.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
from pathlib import Path

from _launch import BENCH, RESULTS, free_port, launch  # bench/ is sys.path[0]
from _rounds import load_average

GOALS = {2: 0.6, 4: 0.35}


def run(n: int, args: argparse.Namespace, tmp: str) -> dict:
    out = os.path.join(tmp, f"fsdp_{n}.json")
    wargs = ["--torch-port", free_port(), "--rounds", args.rounds, "--depth", args.depth,
             "--out", out] + (["--only", args.only] if args.only else [])
    launch(BENCH / "_fsdp_worker.py", wargs, nproc=n, env={"XLA_FLAGS": None},
           echo=print if args.verbose else None, expect=[out])
    return json.loads(Path(out).read_text())


def table(results: list[dict]) -> str:
    lines = ["| N | variant | step ms | torch FSDP2 / this (time) | state MiB per rank | "
             "state / DDP | XLA peak MiB |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        ms, mem = r["step_ms"], r["memory_bytes"]
        ddp_state = mem.get("jaxpg_ddp", {}).get("state")
        for v in ms:
            state = mem.get(v, {}).get("state")
            peak = mem.get(v, {}).get("peak")
            cells = [str(r["n"]), v, f"{ms[v]:.1f}",
                     f"{ms['torch_fsdp2'] / ms[v]:.2f}" if "torch_fsdp2" in ms else "-",
                     f"{state / 2**20:.1f}" if state else "-",
                     f"{state / ddp_state:.2f}" if state and ddp_state else "-",
                     f"{peak / 2**20:.1f}" if peak else "-"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nprocs", default="2,4")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--only", default="")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--out", default=str(RESULTS / "fsdp.json"))
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in map(int, args.nprocs.split(",")):
            load_before = load_average()
            r = run(n, args, tmp)
            r["load_average_before"], r["load_average_after"] = load_before, load_average()
            results.append(r)
            print(f"N={n}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in r["step_ms"].items()),
                  flush=True)
    goals = {}
    for r in results:
        mem, ms = r["memory_bytes"], r["step_ms"]
        if "jaxpg_stage3" in mem and "jaxpg_ddp" in mem:
            ratio = mem["jaxpg_stage3"]["state"] / mem["jaxpg_ddp"]["state"]
            goals[f"stage3_state_over_ddp_n{r['n']}"] = {
                "value": ratio, "goal": GOALS.get(r["n"]), "met": ratio <= GOALS.get(r["n"], 1)}
        if "jaxpg_stage3" in ms and "torch_fsdp2" in ms:
            speed = ms["torch_fsdp2"] / ms["jaxpg_stage3"]
            goals[f"torch_fsdp2_time_over_stage3_n{r['n']}"] = {
                "value": speed, "goal": 1.0, "met": speed >= 1.0}
    out = {"when": datetime.datetime.now().isoformat(timespec="seconds"),
           "cpu_count": os.cpu_count(), "results": results, "goals": goals}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(table(results))
    for k, g in goals.items():
        print(f"{k}: {g['value']:.2f} (goal {g['goal']}) {'met' if g['met'] else 'NOT met'}")


# python -m bench fsdp --quick: a short run, written under /tmp unless --out is given
QUICK_ARGS = ["--nprocs", "2", "--rounds", "1"]

if __name__ == "__main__":
    main()
