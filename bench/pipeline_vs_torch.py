"""jaxpg's pipelines against torch.distributed.pipelining, side by side in the same processes.

For each ``p`` in ``--nprocs``: ``p`` processes (``jaxpg-run --nproc-per-node p``), one
pipeline rank each, pinned by the launcher to its own CPU core (two to a core when
``p`` is more than the cores), one CPU device for JAX and ``torch.set_num_threads(1)``
for torch. In every process run: jaxpg's ``pipeline_value_and_grad`` with the process
executor (``executor="mpmd"``: each rank runs its own actions, point-to-point transfers
over XLA's gloo collectives), optionally (``--lockstep``) the lockstep SPMD executor
(``executor="spmd"``, one jitted program), and torch's ``PipelineStage`` + schedule (a
gloo process group of the same processes). Per round every variant runs once, in a
rotating order, so all see the same load; ratios are medians over rounds of the
per-round ratio (below 1: jaxpg faster), of the wall time and of the CPU time (the
ranks' summed process CPU time). ``efficiency`` is a step against the bound from its
framework's own un-pipelined step on one core, ``T1 (m + p - 1) / (m p)``
(``jaxpg.pipeline.schedule.costs.ideal_step_time``), per round.

The model is identical in both: ``--blocks`` residual MLP blocks
``x + W2 gelu(W1 x + b1) + b2`` (tanh gelu), width ``--dim``, hidden ``4 dim``, mean
squared error per microbatch, the same weights and batch, cut into the same stages (one
per rank, or two for the two-chunk schedules: stages ``r`` and ``r + p``, or ``r`` and
``2p - 1 - r`` for the V). Before timing, every variant's loss and gradients are checked
against jaxpg's un-pipelined step on the same weights.

Pairs (jaxpg schedule / torch class): GPipe / ``ScheduleGPipe``, 1F1B / ``Schedule1F1B``,
interleaved 1F1B / ``ScheduleInterleaved1F1B``, ZB-V / ``ScheduleZBVZeroBubble``; torch
has no ZB-H1, so ZB-H1 is set beside ``Schedule1F1B`` (the same stages and memory bound),
and ``ScheduleInterleavedZeroBubble`` (no jaxpg schedule) beside jaxpg's ZB-V (the other
two-chunk zero-bubble schedule). The zero-bubble rows also give jaxpg's ZB-H1 / 1F1B and
ZB-V / interleaved 1F1B step-time ratios (per round), and what the cost model
(``jaxpg.pipeline.schedule.costs.timed``, with the stage's F, B and W timed on this machine by
``measure_costs``) predicts for them.

    python bench/pipeline_vs_torch.py [--nprocs 2,4] [--ms 4,8,16] [--rounds 5] [--lockstep]
    python bench/pipeline_vs_torch.py --quick      # p = 2, m = 8, 3 rounds: a few minutes

Writes ``bench/results/pipeline_vs_torch.json`` (and ``.png``) and prints markdown tables.
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
from _pipeline_mp_worker import CHUNKS, TORCH
from _rounds import load_average, ratio_median

from jaxpg.pipeline.schedule.costs import ideal_step_time

PAIRS = [  # (jaxpg schedule, torch class, how they relate)
    ("gpipe", "ScheduleGPipe", "same"),
    ("1f1b", "Schedule1F1B", "same"),
    ("interleaved_1f1b", "ScheduleInterleaved1F1B", "same"),
    ("zb_v", "ScheduleZBVZeroBubble", "same"),
    ("zb_h1", "Schedule1F1B", "nearest"),
    ("zb_v", "ScheduleInterleavedZeroBubble", "nearest"),
]
ZERO_BUBBLE = [("zb_h1", "1f1b"), ("zb_v", "interleaved_1f1b")]


def efficiency(bound_s: list[float], step_s: list[float], m: int, p: int) -> float:
    """The median over rounds of ``ideal_step_time(T, p, m) / step``: a step against the
    bound that a one-core step ``T`` of round r gives."""
    return statistics.median(ideal_step_time(a, p, m) / b
                             for a, b in zip(bound_s, step_s, strict=True))


def compare_rows(raw: dict, ms: list[int], executor_key: str = "jaxpg-mpmd") -> list[dict]:
    """One row per (m, jaxpg schedule, torch class) of one launch's raw times."""
    times, p = raw["times"], raw["p"]
    rows = []
    for m in ms:
        t1 = {"jaxpg": times[f"baseline m={m}"]["wall_s"],
              "torch": times[f"torch baseline m={m}"]["wall_s"]}  # fmt: skip
        for name, cls, relation in PAIRS:
            jrec = times.get(f"{executor_key} {name} m={m}")
            lrec = times.get(f"jaxpg {name} m={m}")
            trec = times.get(f"torch {cls} m={m}")
            if jrec is None or trec is None:
                continue
            row = {"p": p, "m": m, "schedule": name, "torch_class": cls, "relation": relation,
                   "jaxpg_ms": jrec["median_ms"], "torch_ms": trec["median_ms"],
                   "jaxpg_over_torch": ratio_median(jrec["wall_s"], trec["wall_s"]),
                   "jaxpg_over_torch_cpu": statistics.median(
                       sum(a) / sum(b) for a, b in zip(jrec["cpu_s_per_rank"],
                                                       trec["cpu_s_per_rank"], strict=True)),
                   "jaxpg_efficiency": efficiency(t1["jaxpg"], jrec["wall_s"], m, p),
                   "torch_efficiency": efficiency(t1["torch"], trec["wall_s"], m, p)}
            for fw, rec in (("jaxpg", jrec), ("torch", trec)):
                prefix = "torch " if fw == "torch" else ""
                # against the same microbatches run one after another on one core: the
                # pipeline's own work, without the cost of small matmuls
                same = times.get(f"{prefix}baseline_microbatched m={m}")
                if same is not None:
                    row[f"{fw}_efficiency_same_work"] = efficiency(same["wall_s"], rec["wall_s"],
                                                                   m, p)  # fmt: skip
                # the one-core step alone against the same step on every rank at once: the
                # ceiling that all cores busy put on any efficiency above
                both = times.get(f"{prefix}baseline_every_rank m={m}")
                if both is not None:
                    row[f"{fw}_efficiency_ceiling"] = ratio_median(t1[fw], both["wall_s"])
            if lrec is not None:
                row["lockstep_ms"] = lrec["median_ms"]
                row["mpmd_over_lockstep"] = ratio_median(jrec["wall_s"], lrec["wall_s"])
            rows.append(row)
    return rows


def zero_bubble_rows(raw: dict, ms: list[int], predicted: dict) -> list[dict]:
    times, p = raw["times"], raw["p"]
    rows = []
    for m in ms:
        for zb, base in ZERO_BUBBLE:
            a, b = times.get(f"jaxpg-mpmd {zb} m={m}"), times.get(f"jaxpg-mpmd {base} m={m}")
            if a is None or b is None:
                continue
            row = {"p": p, "m": m, "ratio": f"{zb} / {base}",
                   "measured": ratio_median(a["wall_s"], b["wall_s"]),
                   "measured_cpu": statistics.median(
                       sum(x) / sum(y) for x, y in zip(a["cpu_s_per_rank"], b["cpu_s_per_rank"],
                                                       strict=True)),
                   **predicted.get(f"{zb} / {base} p={p} m={m}", {})}  # fmt: skip
            t = {c: times.get(f"torch {c} m={m}") for c in ("ScheduleZBVZeroBubble",
                                                           "ScheduleInterleaved1F1B")}
            if zb == "zb_v" and all(t.values()):
                row["torch_zbv_over_interleaved"] = ratio_median(
                    t["ScheduleZBVZeroBubble"]["wall_s"], t["ScheduleInterleaved1F1B"]["wall_s"])
            rows.append(row)
    return rows


def predictions(ps: list[int], ms: list[int], blocks: int, dim: int, rows: int) -> dict:
    """What ``costs.timed`` predicts for ZB-H1 / 1F1B and ZB-V / interleaved: with the
    papers' unit costs, and with one stage's F, B and W timed here (``measure_costs``)."""
    import jax
    import jax.numpy as jnp
    from _pipeline_mp_worker import make_params, per_block, stage_fn

    from jaxpg.pipeline import get_schedule
    from jaxpg.pipeline.schedule.costs import ActionCosts, default_costs, timed
    from jaxpg.pipeline.stage.measured_costs import measure_costs

    out = {}
    for p in ps:
        layers = blocks // p
        params = jax.tree.map(jnp.asarray, per_block(make_params(layers, dim)))
        x = jnp.ones((rows, dim), jnp.float32)
        whole = measure_costs(stage_fn(layers), params, x, split_backward=False, repeats=7)
        split = measure_costs(stage_fn(layers), params, x, split_backward=True, repeats=7)
        for m in ms:
            for zb, base in ZERO_BUBBLE:
                v = CHUNKS[zb]
                tz, tb = get_schedule(zb, p, m, v), get_schedule(base, p, m, v)
                # a two-chunk action is half a stage's: its costs scale together (ratios hold)
                measured = timed(tz, split).makespan / timed(tb, ActionCosts(
                    1.0, whole.B, 0.0)).makespan
                unit = timed(tz, default_costs(tz)).makespan / timed(
                    tb, default_costs(tb)).makespan
                out[f"{zb} / {base} p={p} m={m}"] = {
                    "predicted_unit_costs": unit, "predicted_measured_costs": measured,
                    "costs_whole": list(whole), "costs_split": list(split)}
    return out


def table(rows: list[dict]) -> str:
    lines = ["| p | m | jaxpg schedule | torch class | jaxpg ms | torch ms | jaxpg / torch "
             "| CPU time ratio | efficiency jaxpg | efficiency torch | same-work efficiency "
             "jaxpg | same-work efficiency torch | ceiling jaxpg | ceiling torch | lockstep ms |",
             "|---:|---:|---|---|" + "---:|" * 11]  # fmt: skip

    def f(v):
        return "-" if v is None else f"{v:.2f}"

    for r in rows:
        cls = r["torch_class"] + (" (nearest)" if r["relation"] == "nearest" else "")
        lines.append(
            f"| {r['p']} | {r['m']} | {r['schedule']} | {cls} | {r['jaxpg_ms']:.0f} "
            f"| {r['torch_ms']:.0f} | {r['jaxpg_over_torch']:.2f} "
            f"| {r['jaxpg_over_torch_cpu']:.2f} | {r['jaxpg_efficiency']:.2f} "
            f"| {r['torch_efficiency']:.2f} | {f(r.get('jaxpg_efficiency_same_work'))} "
            f"| {f(r.get('torch_efficiency_same_work'))} | {f(r.get('jaxpg_efficiency_ceiling'))} "
            f"| {f(r.get('torch_efficiency_ceiling'))} | "
            + (f"{r['lockstep_ms']:.0f} |" if "lockstep_ms" in r else "- |"))
    return "\n".join(lines)


def zb_table(rows: list[dict]) -> str:
    lines = ["| p | m | ratio | measured (wall) | measured (CPU) | predicted, unit costs "
             "| predicted, measured costs | torch ZBV / Interleaved1F1B |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip

    def f(v):
        return "-" if v is None else f"{v:.3f}"

    for r in rows:
        lines.append(f"| {r['p']} | {r['m']} | {r['ratio']} | {f(r['measured'])} "
                     f"| {f(r['measured_cpu'])} | {f(r.get('predicted_unit_costs'))} "
                     f"| {f(r.get('predicted_measured_costs'))} "
                     f"| {f(r.get('torch_zbv_over_interleaved'))} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["p"], r["m"]) for r in rows})
    fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 4.2), squeeze=False)
    for ax, (p, m) in zip(axes[0], cases, strict=True):
        mine = [r for r in rows if (r["p"], r["m"]) == (p, m)]
        labels = [f"{r['schedule']}\nvs {r['torch_class'].removeprefix('Schedule')}"
                  for r in mine]
        xs = range(len(mine))
        ax.bar([x - 0.2 for x in xs], [r["jaxpg_ms"] for r in mine], 0.4, label="jaxpg (mpmd)")
        ax.bar([x + 0.2 for x in xs], [r["torch_ms"] for r in mine], 0.4, label="torch")
        for x, r in zip(xs, mine, strict=True):
            ax.text(x, max(r["jaxpg_ms"], r["torch_ms"]), f"{r['jaxpg_over_torch']:.2f}",
                    ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), labels, rotation=60, fontsize=7)
        ax.set_title(f"p = {p}, m = {m} (label: jaxpg / torch)", fontsize=9)
        ax.set_ylabel("ms per step (median)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", default="2,4", help="pipeline ranks p (processes), each a run")
    ap.add_argument("--ms", default="4,8,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--microbatch", type=int, default=64)
    ap.add_argument("--lockstep", action="store_true", help="also time the SPMD executor")
    ap.add_argument("--quick", action="store_true", help="p = 2, m = 8, 3 rounds")
    ap.add_argument("--out", default=str(RESULTS / "pipeline_vs_torch.json"))
    ap.add_argument("--retabulate", action="store_true",
                    help="only rebuild the rows and tables of --out from its raw times")
    args = ap.parse_args()
    if args.retabulate:
        result = json.loads(Path(args.out).read_text())
        ms = result["config"]["ms"]
        result["rows"] = [r for raw in result["raw"] for r in compare_rows(raw, ms)]
        result["zero_bubble"] = [r for raw in result["raw"] for r in zero_bubble_rows(
            raw, ms, result.get("predictions", {}))]
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(table(result["rows"]) + "\n\n" + zb_table(result["zero_bubble"]))
        return
    if args.quick:
        args.nprocs, args.ms, args.rounds = "2", "8", 3
    import torch

    ps = [int(v) for v in args.nprocs.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    chunks = max(CHUNKS.values())
    for p in ps:
        if args.blocks % (p * chunks):
            raise SystemExit(f"--blocks {args.blocks} does not divide into {p * chunks} stages "
                             f"of whole blocks (p = {p}, {chunks} chunks a rank for the "
                             f"two-chunk schedules): pass a multiple of {p * chunks}")
    executors = "mpmd,spmd" if args.lockstep else "mpmd"
    raws, loads, load_before = [], [os.getloadavg()[0]], load_average()
    with tempfile.TemporaryDirectory() as tmp:
        for p in ps:
            raw_path = os.path.join(tmp, f"raw{p}.json")
            _pipeline_mp.launch(p, [
                "--baseline", "--schedules", ",".join(CHUNKS), "--executors", executors,
                "--torch", ",".join(TORCH), "--ms", ",".join(map(str, ms)),
                "--rounds", str(args.rounds), "--out", raw_path, "--blocks", str(args.blocks),
                "--dim", str(args.dim), "--microbatch", str(args.microbatch),
            ])  # fmt: skip
            raws.append(json.loads(Path(raw_path).read_text()))
            loads.append(os.getloadavg()[0])
    predicted = predictions(ps, ms, args.blocks, args.dim, args.microbatch)
    rows = [r for raw in raws for r in compare_rows(raw, ms)]
    zb = [r for raw in raws for r in zero_bubble_rows(raw, ms, predicted)]
    result = {
        "config": {
            "nprocs": ps, "blocks": args.blocks, "dim": args.dim, "hidden": 4 * args.dim,
            "microbatch_rows": args.microbatch, "ms": ms, "rounds": args.rounds,
            "remat": False, "torch": torch.__version__, "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "executors": executors,
            "layout": "one process per pipeline rank under jaxpg-run, pinned to its own core "
                      "(two to a core when p exceeds the cores); jaxpg and torch (gloo group, "
                      "1 thread) in the same processes, variants interleaved per round",
        },
        "load_1min": loads, "load_average_before": load_before,
        "load_average_after": load_average(), "rows": rows, "zero_bubble": zb,
        "predictions": predicted,
        "raw": raws,
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(rows, out.with_suffix(".png"))
    for raw in raws:
        print(json.dumps(raw["checks"]))
    print(table(rows) + "\n\n" + zb_table(zb))
    print(f"load average (1 min): {[round(v, 1) for v in loads]}")
    print(f"written to {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
