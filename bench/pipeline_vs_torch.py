"""jaxpg's pipeline against torch.distributed.pipelining, side by side in the same processes.

``p`` processes (``jaxpg-run --nproc-per-node p``), each pinned by the launcher to its own
CPU core, one CPU device for JAX and ``torch.set_num_threads(1)`` for torch. In every
process both run: jaxpg's ``pipeline_value_and_grad`` (``ppermute`` over XLA's gloo
collectives) and torch's ``PipelineStage`` + schedule (a gloo process group of the same
processes). Per round, every jaxpg and torch variant runs once, in a rotating order, so
both see the same load; the ratio is the median over rounds of the per-round ratio
``jaxpg / torch`` (below 1: jaxpg faster) of the wall time, and of the CPU time (the
ranks' summed process CPU time: the work done, which the machine's other jobs change
less than the wall time). ``efficiency`` is each framework's step against the bound from
its own un-pipelined step on one core, ``T1 (m + p - 1) / m / p``, per round.

The model is identical: ``--blocks`` residual MLP blocks ``x + W2 gelu(W1 x + b1) + b2``
(tanh gelu in both), width ``--dim``, hidden ``4 dim``, mean squared error per
microbatch, the same weights and batch, cut into the same stages (1 per rank, or 2 for
the interleaved and V schedules: torch's stage ``r`` and ``r + p``, or ``r`` and
``2p - 1 - r`` for ZB-V, as jaxpg's). Before timing, every torch schedule's loss and
gradients are checked against jaxpg's un-pipelined step on the same weights (and every
jaxpg schedule's too). The un-pipelined step of each framework on one core is timed as
well (``baseline``).

Pairs: GPipe / ``ScheduleGPipe``, 1F1B / ``Schedule1F1B``, interleaved 1F1B /
``ScheduleInterleaved1F1B``, ZB-V / ``ScheduleZBVZeroBubble``; ZB-H1 (no torch class) and
``ScheduleInterleavedZeroBubble`` (no jaxpg schedule) are listed alone.

    python bench/pipeline_vs_torch.py [--nproc 2] [--ms 8,16] [--rounds 7]

Writes ``bench/results/pipeline_vs_torch.json`` and prints a markdown table.
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
from _pipeline_mp_worker import CHUNKS, TORCH

PAIRS = [
    ("gpipe", "ScheduleGPipe"),
    ("1f1b", "Schedule1F1B"),
    ("interleaved_1f1b", "ScheduleInterleaved1F1B"),
    ("zb_v", "ScheduleZBVZeroBubble"),
    ("zb_h1", None),
    (None, "ScheduleInterleavedZeroBubble"),
]


def compare_rows(raw: dict, ms: list[int]) -> list[dict]:
    times, p = raw["times"], raw["p"]
    rows = []
    for m in ms:
        own_t1 = {"jaxpg": times[f"baseline m={m}"]["wall_s"],
                  "torch": times[f"torch baseline m={m}"]["wall_s"]}  # fmt: skip
        pairs = [("baseline", "baseline", "torch baseline")] + [
            (j or t, j and f"jaxpg {j}", t and f"torch {t}") for j, t in PAIRS
        ]
        for name, jkey, tkey in pairs:
            jrec = times.get(f"{jkey} m={m}") if jkey else None
            trec = times.get(f"{tkey} m={m}") if tkey else None
            row = {
                "schedule": name, "m": m,
                "torch_class": tkey[6:] if tkey and tkey != "torch baseline" else None,
                "jaxpg_ms": jrec and jrec["median_ms"],
                "torch_ms": trec and trec["median_ms"],
            }  # fmt: skip
            for rec, fw in ((jrec, "jaxpg"), (trec, "torch")):
                if rec:
                    row[f"{fw}_cpu_ms"] = 1e3 * statistics.median(
                        sum(c) for c in rec["cpu_s_per_rank"]
                    )
                if rec and name != "baseline":  # against its own un-pipelined step
                    row[f"{fw}_efficiency"] = statistics.median(
                        a * (m + p - 1) / m / p / b
                        for a, b in zip(own_t1[fw], rec["wall_s"], strict=True)
                    )
            if jrec and trec:
                row["jaxpg_over_torch_cpu"] = statistics.median(
                    sum(a) / sum(b)
                    for a, b in zip(jrec["cpu_s_per_rank"], trec["cpu_s_per_rank"], strict=True)
                )
                row["jaxpg_over_torch"] = statistics.median(
                    a / b for a, b in zip(jrec["wall_s"], trec["wall_s"], strict=True)
                )
            rows.append(row)
    return rows


def table(rows: list[dict], p: int) -> str:
    lines = [f"| schedule (p = {p}) | torch class | m | jaxpg ms | torch ms | jaxpg / torch "
             "| jaxpg / torch, CPU time | efficiency jaxpg | efficiency torch |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    for r in rows:
        lines.append(
            f"| {r['schedule']} | {r['torch_class'] or '-'} | {r['m']} | "
            f"{fmt(r['jaxpg_ms'], '.0f')} | {fmt(r['torch_ms'], '.0f')} | "
            f"{fmt(r.get('jaxpg_over_torch'), '.2f')} | "
            f"{fmt(r.get('jaxpg_over_torch_cpu'), '.2f')} | "
            f"{fmt(r.get('jaxpg_efficiency'), '.2f')} | {fmt(r.get('torch_efficiency'), '.2f')} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="pipeline ranks p (processes)")
    ap.add_argument("--ms", default="8,16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--microbatch", type=int, default=64)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                         "pipeline_vs_torch.json"))  # fmt: skip
    ap.add_argument("--retabulate", action="store_true",
                    help="only rebuild the rows and table of --out from its raw times")  # fmt: skip
    args = ap.parse_args()
    if args.retabulate:
        result = json.loads(Path(args.out).read_text())
        result["rows"] = compare_rows(result["raw"], result["config"]["ms"])
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(table(result["rows"], result["config"]["p"]))
        return
    import torch

    ms = [int(v) for v in args.ms.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = os.path.join(tmp, "raw.json")
        _pipeline_mp.launch(args.nproc, [
            "--baseline", "--schedules", ",".join(CHUNKS), "--torch", ",".join(TORCH),
            "--ms", args.ms, "--rounds", str(args.rounds), "--out", raw_path,
            "--blocks", str(args.blocks), "--dim", str(args.dim),
            "--microbatch", str(args.microbatch),
        ])  # fmt: skip
        raw = json.loads(Path(raw_path).read_text())
    result = {
        "config": {
            "p": args.nproc, "blocks": args.blocks, "dim": args.dim, "hidden": 4 * args.dim,
            "microbatch_rows": args.microbatch, "ms": ms, "rounds": args.rounds,
            "remat": False, "torch": torch.__version__, "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "layout": "one process per pipeline rank under jaxpg-run, each pinned to its "
                      "own core; jaxpg and torch (gloo group, 1 thread) in the same "
                      "processes, variants interleaved per round",
            "note": "2-core machine shared with other jobs; ratios are per-round medians",
        },
        "rows": compare_rows(raw, ms),
        "raw": raw,
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(raw["checks"], indent=1))
    print(table(result["rows"], args.nproc))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
