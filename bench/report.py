"""Writes the benchmark page's generated tables from bench/results/*.json.

Run after the benchmarks: ``python bench/report.py`` replaces the text between the
``<!-- BENCHMARKS -->`` and ``<!-- /BENCHMARKS -->`` markers in docs/benchmarks.md, and in
docs/planner.md each block between ``<!-- planner: RUN -->`` and ``<!-- /planner -->`` with
that stored run's table of layouts (``RUN``: ``default`` or a configuration of
bench/results/planner.json), and each ``<!-- planner-memory: MODEL -->`` block with the
stored ``--memory`` run's table for that model.
"""

from __future__ import annotations

import json
import re

from _launch import RESULTS, ROOT  # bench/ is sys.path[0]
from _planner_cases import ranks
from _sizes import fmt_size


def _load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def collectives() -> list[str]:
    d = _load("collectives.json")
    if d is None:
        return []
    out = ["## Collectives, one process, 8 simulated CPU devices "
           "(`python -m bench collectives`)", "",
           "Eager jaxpg call (input already a sharded global array, and a fresh numpy array) "
           "against a hand-written jitted `shard_map` of the same lax op; medians.", "",
           "| size | collective | hand-written µs | eager µs | overhead | eager from numpy µs "
           "| busbw GB/s (eager) |", "|---:|---|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        if r["size_bytes"] not in (1024, 1 << 20, 16 << 20):
            continue
        m, o = r["median_us"], r["overhead_pct"]
        out.append(f"| {fmt_size(r['size_bytes'])} | {r['collective']} | {m['handwritten']:.0f} | "
                   f"{m['eager_sharded']:.0f} | {o['eager_sharded']:+.1f}% | "
                   f"{m['eager_host']:.0f} | {r['busbw_GBps']['eager_sharded']:.3f} |")
    return out + ["", "The default stops at 16 MB per rank: at 64 MB (`--max-size 64M`) one call "
                  "took 0.5-1.5 s on this 2-core machine, so the three variants of five "
                  "collectives got about 3 rounds each in another 3 minutes, too few for a "
                  "median (the same kernels measured +-20% apart from run to run).", "",
                  "![collectives](../bench/results/collectives.png)", ""]


def collectives_mp() -> list[str]:
    d = _load("collectives_mp.json")
    if d is None:
        return []
    out = ["## Collectives across processes vs torch.distributed (gloo) "
           "(`python -m bench collectives_mp`)", "",
           "Bus bandwidth (nccl-tests' definitions) of jaxpg's eager call, torch 2.13 gloo, and a "
           "plain jitted `psum` across the same JAX processes (the XLA floor); medians. Every size "
           "from 4 KB to 64 MB is in `bench/results/collectives_mp.json`.", "",
           "| N | op | size | jaxpg GB/s | torch GB/s | XLA psum GB/s | jaxpg / torch |",
           "|---:|---|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        small = r["size_bytes"] == 4096 and r["op"] == "all_reduce"
        if not small and r["size_bytes"] not in (1 << 20, 64 << 20):
            continue
        b = r["busbw_GBps"]
        ratio = b["jaxpg"] / b["torch"] if b.get("torch") else float("nan")
        xla = f"{b['xla']:.3f}" if b.get("xla") is not None else "-"
        out.append(f"| {r['n']} | {r['op']} | {fmt_size(r['size_bytes'])} | {b['jaxpg']:.3f} | "
                   f"{b.get('torch', float('nan')):.3f} | {xla} | {ratio:.2f} |")
    return out + ["", "![collectives across processes](../bench/results/collectives_mp.png)", ""]


def ddp() -> list[str]:
    d = _load("ddp.json")
    if d is None:
        return []
    cfg = d["config"]
    out = ["## DDP (`python -m bench ddp`)", "",
           f"MLP {cfg['layers']} ({cfg['params'] / 1e6:.1f}M parameters), "
           f"{cfg['per_rank_batch']} samples per rank, {cfg['optimizer']}.", "",
           "| framework | N | where | step ms | samples/s |", "|---|---:|---|---:|---:|"]
    for r in d["frameworks"]:
        out.append(f"| {r['name']} | {r['n']} | {r['where']} | {r['step_ms']:.0f} | "
                   f"{r['samples_per_s']:.1f} |")
    out += ["", "| N = 2, one process | buckets | samples/s |", "|---|---:|---:|"]
    for r in d["sweep"]:
        out.append(f"| {r['name']} | {r.get('buckets', '-')} | {r['samples_per_s']:.1f} |")
    return out + ["", "![DDP](../bench/results/ddp.png)", ""]


def pipeline() -> list[str]:
    out = []
    b = _load("pipeline_bubbles.json")
    if b is not None:
        out += ["## Pipeline schedules (`python -m bench pipeline_bubbles`, "
                "`python -m bench pipeline`)", "",
                f"Bubble fraction ({b['unit']}), p = 4, m = 8:", "",
                "| schedule | v | ticks | bubble | theory |", "|---|---:|---:|---:|---:|"]
        for r in b["results"]:
            if r["p"] == 4 and r["m"] == 8:
                out.append(f"| {r['schedule']} | {r['v']} | {r['ticks']} | {r['bubble']:.4f} | "
                           f"{r['theory_bubble']:.4f} |")
        out.append("")
    d = _load("pipeline.json")
    if d is not None:
        out += ["Compiled memory (XLA `temp_size_in_bytes`) and saved-activation slots, p = 4:",
                "", "| schedule | m | temp MB | activation slots |", "|---|---:|---:|---:|"]
        for r in d["memory"]:
            out.append(f"| {r['schedule']} | {r['m']} | {r['temp_bytes'] / 1e6:.2f} | "
                       f"{r['act_slots']} |")
        comp = {(r["schedule"], r["m"]): r["compile_s"] for r in d["compile"]}
        out += ["", "| schedule | compile m=8 s | compile m=64 s | ratio |", "|---|---:|---:|---:|"]
        for s in sorted({k[0] for k in comp}):
            if (s, 8) in comp and (s, 64) in comp:
                out.append(f"| {s} | {comp[s, 8]:.2f} | {comp[s, 64]:.2f} | "
                           f"{comp[s, 64] / comp[s, 8]:.2f} |")
        out += ["", "| framework | schedule | m | step ms |", "|---|---|---:|---:|"]
        for r in d["steps"]:
            out.append(f"| {r['framework']} | {r['schedule']} | {r['m']} | {r['step_ms']:.0f} |")
        out += ["", "![1F1B](../bench/results/schedule_1f1b.png)", ""]
    return out


def pipeline_vs_torch() -> list[str]:
    d = _load("pipeline_vs_torch.json")
    if d is None or "zero_bubble" not in d:  # older files: the lockstep executor's table
        return []
    cfg = d["config"]
    out = ["## Process executor vs torch.distributed.pipelining "
           "(`python -m bench pipeline_vs_torch`)", "",
           f"Residual MLP blocks (`--blocks` {cfg['blocks']}) of width {cfg['dim']}, "
           f"microbatches of "
           f"{cfg['microbatch_rows']} rows, one process per pipeline rank; jaxpg "
           f"(`executor='mpmd'`) and torch {cfg['torch']} in the same processes, medians of "
           f"per-round ratios over {cfg['rounds']} rounds; load average (1 min) "
           f"{', '.join(f'{v:.1f}' for v in d['load_1min'])}.", "",
           "| p | m | jaxpg schedule | torch class | jaxpg ms | torch ms | jaxpg / torch "
           "| efficiency jaxpg | efficiency torch |",
           "|---:|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        cls = r["torch_class"] + (" (nearest)" if r["relation"] == "nearest" else "")
        out.append(f"| {r['p']} | {r['m']} | {r['schedule']} | {cls} | {r['jaxpg_ms']:.0f} | "
                   f"{r['torch_ms']:.0f} | {r['jaxpg_over_torch']:.2f} | "
                   f"{r['jaxpg_efficiency']:.2f} | {r['torch_efficiency']:.2f} |")
    out += ["", "| p | m | ratio | measured | predicted (measured costs) |",
            "|---:|---:|---|---:|---:|"]
    for r in d["zero_bubble"]:
        pred = r.get("predicted_measured_costs")
        out.append(f"| {r['p']} | {r['m']} | {r['ratio']} | {r['measured']:.3f} | "
                   + (f"{pred:.3f} |" if pred is not None else "- |"))
    return out + ["", "![pipeline vs torch](../bench/results/pipeline_vs_torch.png)", ""]


def planner_run(name: str) -> list[str]:
    """One stored planner run's layouts, predicted against measured, and its summary."""
    data = _load("planner.json") or {}
    run = data if name == "default" else data.get("configurations", {}).get(name)
    if not run:
        return [f"(no planner run {name!r} in bench/results/planner.json)"]
    rows = run["layouts"]
    moe = any("ep" in r["comm_s"] for r in rows)
    out = ["| layout | predicted s | measured CPU s / device | predicted / measured | "
           "measured wall s |" + (" ep ms |" if moe else "") + " predicted rank | measured "
           "rank |", "|---|---|---|---|---|" + ("---|" if moe else "") + "---|---|"]
    predicted = [r["predicted_s"] for r in rows]
    measured = [r["measured_s"] for r in rows]
    for r, rp, rm in zip(rows, ranks(predicted), ranks(measured)):
        ep = f" {r['comm_s'].get('ep', 0.0) * 1e3:.1f} |" if moe else ""
        out.append(f"| `{r['layout']}` | {r['predicted_s']:.3f} | {r['measured_s']:.3f} | "
                   f"{r['predicted_s'] / r['measured_s']:.2f} | "
                   f"{min(r['measured_wall_s']):.3f} |{ep} {rp} | {rm} |")
    ratio = run["predicted_over_measured"]
    where = "the default run" if name == "default" else f"`configurations.{name}`"
    return out + ["", f"Spearman {run['spearman']:.2f}; the pick (`{run['top_pick']}`) at "
                  f"{run['top_pick_over_best_measured']:.2f}x the best measured; predicted / "
                  f"measured {ratio['median']:.2f} (median, {ratio['min']:.2f} to "
                  f"{ratio['max']:.2f}); {where} of `bench/results/planner.json`."]


def planner_memory(model: str) -> list[str]:
    """The stored ``--memory`` run's table for ``model``: predicted against compiled MiB."""
    data = _load("planner.json") or {}
    run = data.get("configurations", {}).get("memory", {}).get("models", {}).get(model)
    if not run:
        return [f"(no planner memory run for {model!r} in bench/results/planner.json)"]
    out = ["| layout | predicted state | predicted activations + temporaries | predicted total "
           "| compiled state (arguments) | compiled temporaries | compiled peak | predicted / "
           "compiled |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in run["layouts"]:
        p, c = r["predicted_mib"], r["compiled_mib"]
        state = p["params"] + p["grads"] + p["optimizer"]
        out.append(f"| {r['layout']} | {state:.2f} | {p['activations'] + p['temporaries']:.2f} "
                   f"| {p['total']:.2f} | {c['arguments']:.2f} | {c['temporaries']:.2f} | "
                   f"{c['peak']:.2f} | {r['predicted_over_compiled']:.2f} |")
    ratio = run["predicted_over_compiled"]
    return out + ["", f"Predicted / compiled: median {ratio['median']:.2f}, {ratio['min']:.2f} "
                  f"to {ratio['max']:.2f} (`configurations.memory` of "
                  "`bench/results/planner.json`)."]


def fill_planner(text: str) -> str:
    """``text`` with each ``<!-- planner: RUN -->`` block holding that run's table."""
    text = re.sub(r"<!-- planner: (\S+) -->\n.*?<!-- /planner -->",
                  lambda m: (f"<!-- planner: {m.group(1)} -->\n"
                             + "\n".join(planner_run(m.group(1))) + "\n<!-- /planner -->"),
                  text, flags=re.S)
    return re.sub(r"<!-- planner-memory: (\S+) -->\n.*?<!-- /planner-memory -->",
                  lambda m: (f"<!-- planner-memory: {m.group(1)} -->\n"
                             + "\n".join(planner_memory(m.group(1)))
                             + "\n<!-- /planner-memory -->"), text, flags=re.S)


def main() -> None:
    body = "\n".join(collectives() + collectives_mp() + ddp() + pipeline()
                     + pipeline_vs_torch())
    page = ROOT / "docs" / "benchmarks.md"
    text = page.read_text()
    block = f"<!-- BENCHMARKS -->\n{body}\n<!-- /BENCHMARKS -->"
    text = re.sub(r"<!-- BENCHMARKS -->.*?(<!-- /BENCHMARKS -->|$)", lambda _: block, text,
                  count=1, flags=re.S)
    page.write_text(text)
    print(body)
    planner = ROOT / "docs" / "planner.md"
    planner.write_text(fill_planner(planner.read_text()))


if __name__ == "__main__":
    main()
