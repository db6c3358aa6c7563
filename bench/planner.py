"""The layout planner against measurements and published runs (docs/planner.md).

1. Calibrates the ``local`` hardware profile on 8 simulated CPU devices
   (:func:`jaxpg.plan.calibrate.calibrate`, timed by the process's CPU time over the
   devices).
2. For a small GPT, predicts and measures (:func:`jaxpg.plan.trial.compile_trial`, its CPU
   time over the devices: one device's CPU seconds, as the profile predicts) the step time
   of at least 10 layouts over tp, dp_replicate / dp_shard with ZeRO 1 and 3, microbatches
   and recomputation: Spearman's rank correlation, how far the predicted best is from the
   measured best, and the predicted over measured seconds (median, least, most). Every
   layout is compiled first; then each of ``--rounds`` rounds times one step of each
   layout in turn, so that the machine's drift over the run falls on every layout alike,
   and a layout's figure is its fastest round.
3. Megatron-LM's Table 1: the predicted tokens/s per GPU against the published figure.

``--model moe`` measures a small mixture of experts instead (8 experts, top-2; each block's
MLP :func:`jaxpg.expert_parallel.moe`) over 12 layouts with ep = 1, 2, 4 and 8, ZeRO 0, 1
and 3, microbatches and recomputation (store it with ``--configuration moe``).

``--processes 2`` (or 4) splits the 8 devices over that many processes under the launcher,
which the planner sees as nodes (bench/_planner_mp_worker.py: the link between processes
calibrated, the steps timed by each process's CPU time, the slowest process's per round);
its result goes under ``configurations.processes<N>_<model>``.

Each measured layout also records its step's memory on one device as XLA compiles it
(:func:`jaxpg.plan.trial.trial_memory`) beside the planner's prediction. ``--memory`` does
only that, for both models' layouts, compiling and running nothing else (figures that do
not depend on the machine's load; store it with ``--configuration memory``).

``--repredict`` prices every stored run's layouts again with the planner as it now is, from
each run's own calibrated profile, and rewrites their predictions and summaries (the
measurements are kept): what the docs' tables show after a change to the time model.

Writes ``bench/results/planner.json`` (``--quick``: 4 layouts, under the quick folder). XLA
compiles at optimization level 0, as in the test suite, to keep the compiles short; the
calibration and the trials run alike.
"""

from __future__ import annotations

import os

_flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in _flags:  # as the test suite: short compiles
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from _launch import launch  # noqa: E402
from _planner_cases import MODELS, spearman, spread, summary, time_in_rounds  # noqa: E402
from _results import add_flag, save  # noqa: E402  (bench/ is sys.path[0])

from jaxpg.plan import Job, Layout, evaluate, get_model  # noqa: E402
from jaxpg.plan.calibrate import calibrate, collectives_per_tensor  # noqa: E402
from jaxpg.plan.hardware import Hardware, get_hardware, save_hardware  # noqa: E402
from jaxpg.plan.published import MEGATRON_TABLE1, megatron_tokens_per_s  # noqa: E402
from jaxpg.plan.trial import compile_trial, trial_memory  # noqa: E402

QUICK_ARGS: list[str] = ["--quick"]


def megatron_rows() -> list[dict]:
    rows = []
    for run in MEGATRON_TABLE1:
        spec = get_model(run.model)
        job = Job(model=spec, devices=run.gpus, hardware="a100-80gb", seq_len=2048,
                  global_batch=run.batch)
        lay = Layout(dp_replicate=run.dp, tp=run.tp, pp=run.pp,
                     microbatches=run.batch // run.dp, remat="full", sp=False)
        est = evaluate(lay, job)
        published = megatron_tokens_per_s(run, spec)
        rows.append({"model": run.model, "params_b": spec.params / 1e9, "tp": run.tp,
                     "pp": run.pp, "dp": run.dp, "gpus": run.gpus, "batch": run.batch,
                     "published_tflops": run.tflops_per_gpu,
                     "published_tokens_per_s": published,
                     "predicted_tokens_per_s": est.tokens_per_s_per_device,
                     "ratio": est.tokens_per_s_per_device / published,
                     "predicted_memory_gib": est.memory.total_gib,
                     "bubble_fraction": est.time.bubble / est.time.total,
                     "exposed_comm_fraction": est.time.exposed_comm / est.time.total})
    return rows


MIB = 2.0**20


def predicted_memory(est, peak_bytes: float) -> dict:
    """One layout's predicted bytes on a device, in MiB, and over the compiled peak."""
    return {"predicted_mib": {k: v * 1024 for k, v in est.memory.as_gib().items()},
            "predicted_over_compiled": est.memory.total / peak_bytes}


def memory_row(est, compiled) -> dict:
    """One layout's predicted and compiled bytes on a device, in MiB."""
    return {"compiled_mib": {"arguments": compiled.arguments / MIB,
                             "outputs": compiled.outputs / MIB,
                             "aliased": compiled.aliased / MIB,
                             "temporaries": compiled.temporaries / MIB,
                             "peak": compiled.peak / MIB},
            **predicted_memory(est, compiled.peak)}


def memory_job(model, seq_len: int = 128, global_batch: int = 16) -> Job:
    """The job the memory comparison plans (memory does not depend on the rates)."""
    return Job(model=model, devices=8, hardware=get_hardware("h100-80gb"), seq_len=seq_len,
               global_batch=global_batch, dtype="fp32", param_dtype="fp32")


def memory_main(out: pathlib.Path, configuration: str | None) -> int:
    """Predicted against compiled memory for every layout of both models."""
    result = {"compiled": "XLA memory_analysis() of the trial step, one device",
              "seq_len": 128, "global_batch": 16, "models": {}}
    for name, (model, layouts) in MODELS.items():
        job = memory_job(model)
        rows = []
        for text in layouts:
            lay = Layout.parse(text)
            row = {"layout": str(lay), **memory_row(evaluate(lay, job),
                                                     trial_memory(job, lay))}
            rows.append(row)
            print(f"{name} {str(lay):<56} predicted {row['predicted_mib']['total']:6.2f} "
                  f"MiB  compiled {row['compiled_mib']['peak']:6.2f} MiB", flush=True)
        ratios = [r["predicted_over_compiled"] for r in rows]
        result["models"][name] = {"model": model.describe(), "layouts": rows,
                                  "predicted_over_compiled": spread(ratios)}
    # beside the timed runs, never over the default one
    save(out, result, configuration or "memory")
    print(f"wrote {out} (configurations.{configuration or 'memory'})")
    return 0


def repredict_memory(run: dict) -> None:
    """A stored ``--memory`` run's predictions again, against its compiled figures."""
    for name, stored in run["models"].items():
        job = memory_job(MODELS[name][0], run["seq_len"], run["global_batch"])
        for row in stored["layouts"]:
            row.update(predicted_memory(evaluate(Layout.parse(row["layout"]), job),
                                        row["compiled_mib"]["peak"] * MIB))
        ratio = spread([r["predicted_over_compiled"] for r in stored["layouts"]])
        stored["predicted_over_compiled"] = ratio
        print(f"memory {name:<13} predicted / compiled {ratio['median']:.2f} (median, "
              f"{ratio['min']:.2f} to {ratio['max']:.2f})")


def repredict_main(out: pathlib.Path) -> int:
    """Every stored run's predictions and summary again, under the current time model."""
    data = json.loads(out.read_text())
    runs = {"(top level)": data, **data.get("configurations", {})}
    specs = {model.describe(): model for model, _ in MODELS.values()}
    memory_run = data.get("configurations", {}).get("memory")
    if memory_run:
        repredict_memory(memory_run)
    per_tensor = None
    for name, run in runs.items():
        rows = run.get("layouts")
        if not rows or "predicted_s" not in rows[0] or run.get("model") not in specs:
            continue
        if "per_tensor_collectives" not in run["calibrated"]:  # a profile stored before
            # the field: what this machine's XLA does (every stored run is XLA:CPU's)
            if per_tensor is None:
                per_tensor = collectives_per_tensor()
            run["calibrated"]["per_tensor_collectives"] = per_tensor
        job = Job(model=specs[run["model"]], devices=8,
                  hardware=Hardware.from_dict(run["calibrated"]), seq_len=run["seq_len"],
                  global_batch=run["global_batch"], dtype="fp32", param_dtype="fp32")
        before = run["spearman"]
        for row in rows:
            est = evaluate(Layout.parse(row["layout"]), job)
            row["predicted_s"], row["comm_s"] = est.step_s, dict(est.time.comm)
        run.update(summary(rows))
        if "spearman_wall" in run:
            run["spearman_wall"] = spearman([r["predicted_s"] for r in rows],
                                            [min(r["measured_wall_s"]) for r in rows])
        print(f"{name:<20} spearman {before:.3f} -> {run['spearman']:.3f}, pick "
              f"{run['top_pick_over_best_measured']:.3f}, predicted / measured "
              f"{run['predicted_over_measured']['median']:.2f}")
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def processes_main(args, out: pathlib.Path) -> int:
    """The same validation across ``args.processes`` processes (their devices are the
    planner's nodes), by bench/_planner_mp_worker.py under the launcher."""
    load_before = os.getloadavg()
    began = time.time()
    import jax

    per_process = 8 // args.processes
    hw = calibrate(devices=jax.local_devices()[:per_process], dtype="fp32", repeats=3,
                   matmul_size=256, stream_mib=8)
    print(f"calibrated on {per_process} devices in {time.time() - began:.0f} s: {hw}",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = pathlib.Path(tmp) / "planner_mp.json"
        profile = save_hardware(hw, pathlib.Path(tmp) / "local.toml")
        launch(pathlib.Path(__file__).parent / "_planner_mp_worker.py",
               ["--model", args.model, "--rounds", args.rounds, "--out", rows,
                "--hardware", profile, *(["--quick"] if args.quick else [])],
               nproc=args.processes, launcher_args=["--devices-per-proc", per_process],
               # unpinned, as the single-process run: pinned to one core each, a process's
               # simulated devices hand kernels to each other through that core (a kernel's
               # fixed cost measured about 40 times the single process's)
               env={"JAXPG_CPU_AFFINITY": "none"}, echo=print, expect=[rows])
        result = json.loads(rows.read_text())
    result["machine"] = {"cpus": os.cpu_count(), "load_before": load_before,
                         "load_after": os.getloadavg(), "python": sys.version.split()[0]}
    result["seconds"] = time.time() - began
    # beside the single-process runs, never over them
    configuration = args.configuration or f"processes{args.processes}_{args.model}"
    save(out, result, configuration)
    print(f"spearman {result['spearman']:.3f}, top pick {result['top_pick']} at "
          f"{result['top_pick_over_best_measured']:.3f} x the best measured; predicted / "
          f"measured {result['predicted_over_measured']['median']:.2f} (median); wrote {out} "
          f"(configurations.{configuration})")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 layouts, results under /tmp")
    p.add_argument("--rounds", type=int, default=7,
                   help="timed steps per layout, one of each layout a round")
    p.add_argument("--out", type=pathlib.Path)
    p.add_argument("--model", choices=sorted(MODELS), default="gpt",
                   help="the small GPT (default) or the small MoE")
    p.add_argument("--memory", action="store_true",
                   help="only predicted against compiled memory, for both models")
    p.add_argument("--processes", type=int, choices=(2, 4),
                   help="the 8 devices split over 2 or 4 processes (bench/_planner_mp_worker.py)")
    p.add_argument("--repredict", action="store_true",
                   help="price the stored runs' layouts again with the current planner")
    add_flag(p)
    args = p.parse_args(argv)
    out = args.out or (pathlib.Path(tempfile.gettempdir()) / "jaxpg-bench-quick" /
                       "planner.json" if args.quick else
                       pathlib.Path(__file__).parent / "results" / "planner.json")
    if args.repredict:
        return repredict_main(out)
    if args.memory:
        return memory_main(out, args.configuration)
    if args.processes:
        return processes_main(args, out)
    load_before = os.getloadavg()
    began = time.time()
    hw = calibrate(dtype="fp32", repeats=3, matmul_size=256, stream_mib=8)
    print(f"calibrated in {time.time() - began:.0f} s: {hw}", flush=True)
    model, layouts = MODELS[args.model]
    job = Job(model=model, devices=8, hardware=hw, seq_len=128, global_batch=16, dtype="fp32",
              param_dtype="fp32")
    chosen = [Layout.parse(text) for text in (layouts[:4] if args.quick else layouts)]
    trials = [compile_trial(job, lay) for lay in chosen]
    samples = time_in_rounds(trials, args.rounds)
    rows = []
    for lay, trial, taken in zip(chosen, trials, samples):
        est = evaluate(lay, job)
        wall, cpu = zip(*taken)
        # the devices are this process's threads: its CPU time over the devices is one
        # device's work, whatever else the machine runs (wall time kept beside it)
        measured = min(cpu) / job.devices
        rows.append({"layout": str(lay), "predicted_s": est.step_s, "measured_s": measured,
                     "measured_cpu_s": list(cpu), "measured_wall_s": list(wall),
                     "predicted_memory_gib": est.memory.total_gib,
                     **memory_row(est, trial.memory),
                     "comm_s": dict(est.time.comm)})
        print(f"{str(lay):<60} predicted {est.step_s:7.3f} s  measured {measured:7.3f} s",
              flush=True)
    result = {
        "machine": {"cpus": os.cpu_count(), "load_before": load_before,
                    "load_after": os.getloadavg(), "python": sys.version.split()[0]},
        "calibrated": hw.to_dict(),
        "model": model.describe(), "seq_len": job.seq_len, "global_batch": job.global_batch,
        "layouts": rows,
        "measured": "min over rounds of process CPU seconds / devices; each round one "
                    "step of every layout, in turn",
        "rounds": args.rounds,
        **summary(rows),
        "spearman_wall": spearman([r["predicted_s"] for r in rows],
                                  [min(r["measured_wall_s"]) for r in rows]),
        "megatron_table1": megatron_rows(),
        "seconds": time.time() - began,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    save(out, result, args.configuration)
    print(f"spearman {result['spearman']:.3f}, top pick {result['top_pick']} at "
          f"{result['top_pick_over_best_measured']:.3f} x the best measured; predicted / "
          f"measured {result['predicted_over_measured']['median']:.2f} (median); wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
