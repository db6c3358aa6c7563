"""Tensor parallelism: jaxpg against torch's parallelize_module, in the same processes.

For tp = 2 and 4 (``--tp``), one CPU process per rank under jaxpg-run, each process joins a
jaxpg world and a torch gloo world and trains, alternately round by round, an MLP, a
transformer block and the block with sequence parallelism (see
``bench/_tensor_parallel_worker.py``), with the same weights and data in both libraries.
Recorded per model: the step time of each (slowest rank, median over rounds) and their
ratio, the loss of both at the first step, the collectives of jaxpg's compiled step
against Megatron's count, and the parameter bytes per rank.

    flock /tmp/jaxpg-bench.lock python bench/tensor_parallel.py          # ~5-10 min
    flock /tmp/jaxpg-bench.lock python bench/tensor_parallel.py --tp 2 --rounds 4

Writes ``bench/results/tensor_parallel.json`` (``--configuration NAME``: as that named
configuration inside it) and prints markdown tables. The machine is
shared: read the ratios (same processes, interleaved), not the absolute times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

from _launch import BENCH, RESULTS, free_port, launch  # bench/ is sys.path[0]
from _results import add_flag, save
from _rounds import load_average

# Megatron-LM's collectives for one step (forward, then backward with the input gradient)
# of each model; SP: Megatron re-gathers the input of each column-parallel layer in the
# backward for the weight gradient, and all-reduces the LayerNorms' gradients once.
MEGATRON = {
    "mlp": {"forward": "1 all-reduce", "backward": "1 all-reduce"},
    "block": {"forward": "2 all-reduce", "backward": "2 all-reduce"},
    "block_sp": {"forward": "2 all-gather + 2 reduce-scatter",
                 "backward": "2 all-gather + 2 reduce-scatter (+2 all-gathers recomputing "
                             "inputs) + 1 all-reduce of the LayerNorm gradients"},
}


def run(n: int, args, tmp: str) -> dict:
    out = os.path.join(tmp, f"tp{n}.json")
    wargs = ["--torch-port", free_port(), "--rounds", args.rounds, "--models", args.models,
             "--dim", args.dim, "--seq", args.seq, "--batch", args.batch, "--out", out]
    wargs += (["--variants"] if args.variants else []) + (["--compose"] if args.compose else [])
    launch(BENCH / "_tensor_parallel_worker.py", wargs, nproc=n, expect=[out], what=f"tp={n}")
    return json.loads(Path(out).read_text())


def table(results: dict) -> str:
    rows = ["| tp | model | torch step | jaxpg step | jaxpg speed / torch (medians; per round) "
            "| first loss (torch, jaxpg) | jaxpg collectives (compiled step) "
            "| params per rank / full |",
            "|---:|---|---:|---:|---:|---|---|---:|"]
    for n, res in results.items():
        for m, r in res["models"].items():
            c = {k: v for k, v in r["collectives"].items() if v}
            pb = r["param_bytes_per_rank"]
            rows.append(
                f"| {n} | {m} | {r['step_ms']['torch']:.1f} ms | {r['step_ms']['jaxpg']:.1f} ms "
                f"| {r['jaxpg_over_torch_speed']:.2f}x; "
                f"{r['jaxpg_over_torch_speed_per_round_median']:.2f}x "
                f"| {r['first_loss']['torch']:.6f}, "
                f"{r['first_loss']['jaxpg']:.6f} | "
                f"{', '.join(f'{v} {k}' for k, v in c.items())} | "
                f"{pb['jaxpg'] / pb['full']:.3f} (torch {pb['torch'] / pb['full']:.3f}) |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", default="2,4", help="comma-separated tensor-parallel degrees")
    p.add_argument("--models", default="mlp,block,block_sp")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--variants", action="store_true",
                   help="also time jaxpg's step with XLA's default copy insertion")
    p.add_argument("--compose", action="store_true",
                   help="also time the model through DistributedDataParallel on (dp=1, tp)")
    p.add_argument("--out", default=str(RESULTS / "tensor_parallel.json"))
    add_flag(p)
    args = p.parse_args()
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        results = {int(n): run(int(n), args, tmp) for n in args.tp.split(",")}
    out = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before,
                    "loadavg_after": load_average()},
        "megatron_collectives": MEGATRON,
        "results": results,
    }
    save(args.out, out, args.configuration)
    print(table(results))
    print(f"\nload average before {load_before}, after {load_average()}; wrote {args.out}")


# python -m bench tensor_parallel --quick: a short run, written under /tmp unless --out is given
QUICK_ARGS = ["--rounds", "1"]

if __name__ == "__main__":
    main()
