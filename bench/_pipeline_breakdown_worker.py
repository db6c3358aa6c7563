"""One pipeline rank of ``bench/pipeline_breakdown.py`` (or, with
``--one-process N``, all ranks on N simulated devices of one process).

For each schedule, after two warm-up steps:

* the lockstep executor (``executor="spmd"``, one jitted program): one step under
  ``jax.profiler``; from the trace, per tick and per rank, the *compute* (from the end of
  the last tick's transfer to the start of this tick's) and the *transfer* (the
  ``ppermute`` itself: moving the bytes and waiting for every rank to enter it). Rank 0
  later splits the transfer into the bytes' time (the shortest rank's: the last to
  arrive barely waits) and each rank's wait;
* the process executor (``executor="mpmd"``, across processes only): ``--steps`` steps
  under ``jaxpg.pipeline.process.step_timeline.record_timeline``: per rank the compute, the idle
  time, the host's waits for messages and the lanes' transfer time;
* the step time of each, untraced (median of ``--steps``).

Rank 0 writes everything as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

if "--one-process" in sys.argv:
    n = sys.argv[sys.argv.index("--one-process") + 1]
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={n}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

# bench/: the pipeline workers' model and steps, and the shared timing loop
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _pipeline_mp_worker import CHUNKS, jaxpg_step, make_batch, make_params, staged  # noqa: E402
from _rounds import run_rounds  # noqa: E402


def trace_ticks(fn, ticks: int) -> tuple[dict[Any, list[dict]], float]:
    """Runs ``fn`` once under the profiler; per device, per tick: compute and transfer
    seconds. A tick's transfers are its ``ppermute`` events (one or two). Also returns the
    traced step's wall time."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            begin = time.perf_counter()
            jax.block_until_ready(fn())
            traced = time.perf_counter() - begin
        path = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[0]
        with gzip.open(path) as f:
            data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    spans = [e for e in events if e.get("ph") == "X"]

    def device(e):  # XLA's thunks name their device; a device may change threads
        return e.get("args", {}).get("device_ordinal", e["tid"])

    loops = [e for e in spans if e["name"].startswith("while")]
    perms_all = [e for e in spans if e["name"].startswith("ppermute")]
    out = {}
    for dev in sorted({device(e) for e in perms_all}, key=str):
        perms = sorted((e for e in perms_all if device(e) == dev), key=lambda e: e["ts"])
        per_tick = len(perms) // ticks
        if per_tick == 0 or len(perms) % ticks:
            raise RuntimeError(f"device {dev}: {len(perms)} ppermutes for {ticks} ticks")
        loop = min((e for e in loops if device(e) == dev), key=lambda e: e["ts"], default=None)
        last_end = loop["ts"] if loop else perms[0]["ts"]
        rows = []
        for t in range(ticks):
            group = perms[t * per_tick:(t + 1) * per_tick]
            start = group[0]["ts"]
            rows.append({"compute": (start - last_end) * 1e-6,
                         "transfer": sum(e["dur"] for e in group) * 1e-6})
            last_end = group[-1]["ts"] + group[-1]["dur"]
        out[dev] = rows
    return out, traced


def timed_steps(fn, steps: int, barrier) -> list[float]:
    return run_rounds({"step": fn}, steps, barrier=barrier).wall["step"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--torch-port", type=int, default=0, help="unused (the launcher's)")
    ap.add_argument("--one-process", type=int, default=0)
    ap.add_argument("--schedules", default="1f1b,zb_h1")
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--microbatch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from jaxpg.pipeline import get_schedule
    from jaxpg.pipeline.process.step_timeline import record_timeline, summarize
    from jaxpg.pipeline.stage.order import to_rank_order

    if args.one_process:
        rank, p = 0, args.one_process
        devices = jax.devices()[:p]

        def barrier():
            return None
    else:
        import jaxpg

        jaxpg.init_process_group()
        rank, p = jaxpg.get_rank(), jaxpg.get_world_size()
        devices = jax.devices()
        barrier = jaxpg.barrier
    mesh = Mesh(np.array(devices), ("pp",))
    params = make_params(args.blocks, args.dim)
    x, t = make_batch(args.m * args.microbatch, args.dim)
    gx, gt = (jax.device_put(a, NamedSharding(mesh, P())) for a in (x, t))
    result = {}
    for name in args.schedules.split(","):
        v = CHUNKS[name]
        tt = get_schedule(name, p, args.m, v)
        sp = jax.device_put(to_rank_order(staged(params, p * v), tt),
                            NamedSharding(mesh, P("pp")))
        layers = args.blocks // (p * v)
        mine = {}
        executors = ["spmd"] + ([] if args.one_process else ["mpmd"])
        for executor in executors:
            step = jaxpg_step(name, mesh, args.m, layers, stage_order="rank", executor=executor)
            fn = lambda step=step, sp=sp: step(sp, gx, gt)  # noqa: E731
            if rank == 0:
                print(f"{name} {executor}: warm-up", flush=True)
            for _ in range(2):
                jax.block_until_ready(fn())
            walls = timed_steps(fn, args.steps, barrier)
            rec = {"step_s": statistics.median(walls), "walls": walls}
            if rank == 0:
                print(f"{name} {executor}: {1e3 * statistics.median(walls):.0f} ms a step; "
                      "tracing", flush=True)
            if executor == "spmd":
                barrier()
                ticks, rec["traced_step_s"] = trace_ticks(fn, tt.num_ticks)
                rec["ticks"] = {str(k): v for k, v in ticks.items()}
            else:
                with record_timeline() as tl:
                    timed_steps(fn, args.steps, barrier)
                rows = summarize(tl.events)
                rec["timeline"] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            mine[executor] = rec
        result[name] = {"ticks": tt.num_ticks, "ranks": {str(rank): mine}}
    if not args.one_process:
        import jaxpg

        everyone = jaxpg.all_gather_object(result)
        for name in result:
            for other in everyone:
                result[name]["ranks"].update(other[name]["ranks"])
    if rank == 0:
        result = {"p": p, "one_process": bool(args.one_process), "load_1min": os.getloadavg()[0],
                  "affinity": sorted(os.sched_getaffinity(0)), "schedules": result}
        with open(args.out, "w") as f:
            json.dump(result, f)
    if not args.one_process:
        import jaxpg

        jaxpg.barrier()
        jaxpg.destroy_process_group()


if __name__ == "__main__":
    main()
