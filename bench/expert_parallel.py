"""Expert parallelism: ``moe``'s step time and memory by ep and E, the share of the exchange,
dropless against a capacity, and jaxpg against a torch layer built on ``all_to_all_single``.

* ``single`` (``bench/_expert_parallel_single.py``, one process, 4 simulated CPU devices):
  step time and per-device memory at ep = 1, 2, 4 for E = 8 and 16; the exchange's share of
  the step; dropless against capacity factor 1.25 at ep = 4.
* ``torch`` (``bench/_expert_parallel_worker.py`` under jaxpg-run, one CPU process per
  rank, ep = 2 and 4): jaxpg's ``moe`` and a torch MoE written with ``all_to_all_single`` in
  the same processes on the same inputs, their losses and gradients checked equal first.

``bench/_expert_parallel_profile.py`` (run by hand, one process) times one rank's step part
by part beside torch's, the exchange made the identity.

    flock /tmp/jaxpg-bench.lock python bench/expert_parallel.py                 # ~5 min
    flock /tmp/jaxpg-bench.lock python bench/expert_parallel.py --parts torch --eps 2

Writes ``bench/results/expert_parallel.json`` (``--configuration NAME``: as that named
configuration inside it) and prints markdown tables. The machine is
shared: read the ratios (interleaved round by round), and the load average beside them.
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

SHAPE = ("--tokens", "--dim", "--ffn", "--top-k")


def shape_args(args) -> list[str]:
    return [str(a) for pair in zip(SHAPE, (args.tokens, args.dim, args.ffn, args.top_k),
                                   strict=True) for a in pair]


def run_single(args) -> dict:
    done = launch(BENCH / "_expert_parallel_single.py", ["--rounds", args.rounds,
                                                         *shape_args(args)], timeout=3600)
    lines = [ln for ln in (done.output or "").splitlines() if ln.startswith("JSON ")]
    if not lines:
        raise SystemExit(f"single printed no JSON line:\n{done.tail()}")
    return json.loads(lines[-1][5:])


def run_torch(ep: int, experts: int, args, tmp: str) -> dict:
    out = os.path.join(tmp, f"ep{ep}_e{experts}.json")
    done = launch(BENCH / "_expert_parallel_worker.py",
                  ["--torch-port", free_port(), "--rounds", args.rounds, "--experts", experts,
                   "--out", out, *shape_args(args)], nproc=ep, expect=[out], what=f"ep={ep}")
    if "AGREE False" in (done.output or ""):
        raise SystemExit(f"ep={ep}: jaxpg and torch disagree:\n{done.tail()}")
    return json.loads(Path(out).read_text())


def tables(single: dict | None, torch_rows: list[dict]) -> str:
    out = []
    if single and "sweep" in single:
        out += ["| E | ep | step | tokens/s (all ranks) | memory per device (args + out + temp) |",
                "|---:|---:|---:|---:|---:|"]
        for r in single["sweep"]:
            out.append(f"| {r['experts']} | {r['ep']} | {1e3 * r['median_s']:.1f} ms | "
                       f"{r['tokens_per_s']:.0f} | {r['total_bytes'] / 2**20:.2f} MiB "
                       f"({r['argument_bytes'] / 2**20:.2f} + {r['output_bytes'] / 2**20:.2f}"
                       f" + {r['temp_bytes'] / 2**20:.2f}) |")
        out.append("")
    if single and "share" in single:
        out += ["| E | ep | rows per pair | step | exchange alone | share |",
                "|---:|---:|---:|---:|---:|---:|"]
        for r in single["share"]:
            out.append(f"| {r['experts']} | {r['ep']} | {r['rows_per_pair']} | "
                       f"{1e3 * r['step']['median_s']:.1f} ms | "
                       f"{1e3 * r['exchange']['median_s']:.1f} ms | {r['share']:.0%} |")
        out.append("")
    if single and "capacity" in single:
        out += ["| E | ep | mode | rows per pair | step | memory per device |",
                "|---:|---:|---|---:|---:|---:|"]
        for r in single["capacity"]:
            out.append(f"| {r['experts']} | {r['ep']} | {r['mode']} | {r['rows_per_pair']} | "
                       f"{1e3 * r['median_s']:.1f} ms | {r['total_bytes'] / 2**20:.2f} MiB |")
        out.append("")
    if torch_rows:
        out += ["| ep (processes) | E | torch step | jaxpg step | jaxpg time / torch (medians; "
                "per round) | worst-case buffers step | its time / torch | max grad "
                "difference (rank 0) |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in torch_rows:
            worst = r["step_ms"].get("jaxpg_worst_case_buffers")
            out.append(f"| {r['ep']} | {r['experts']} | {r['step_ms']['torch']:.1f} ms | "
                       f"{r['step_ms']['jaxpg']:.1f} ms | {r['jaxpg_over_torch_time']:.2f}x; "
                       f"{r['jaxpg_over_torch_time_per_round_median']:.2f}x | "
                       + (f"{worst:.1f} ms | {r['worst_case_buffers_over_torch_time']:.2f}x | "
                          if worst is not None else "| | ")
                       + f"{max(r['rank0_max_abs_grad_difference'].values()):.1e} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", default=["single", "torch"])
    p.add_argument("--eps", nargs="+", type=int, default=[2, 4], help="processes (torch)")
    p.add_argument("--experts", nargs="+", type=int, default=[8], help="E (torch)")
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=str(RESULTS / "expert_parallel.json"))
    add_flag(p)
    args = p.parse_args()
    load_before = load_average()
    single = run_single(args) if "single" in args.parts else None
    torch_rows = []
    if "torch" in args.parts:
        with tempfile.TemporaryDirectory() as tmp:
            torch_rows = [run_torch(ep, e, args, tmp) for ep in args.eps for e in args.experts]
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before,
                          "loadavg_after": load_average()},
              "single": single, "torch": torch_rows}
    save(args.out, result, args.configuration)
    print(tables(single, torch_rows))
    print(f"\nload average before {load_before}, after {load_average()}; wrote {args.out}")


# python -m bench expert_parallel --quick: a short run, written under /tmp unless --out is given
QUICK_ARGS = ["--rounds", "1"]

if __name__ == "__main__":
    main()
