"""Which layout: N ranks in one process, or one process per rank (torch's), side by side.

The same work runs in both layouts of ``--n`` ranks on this machine's CPU:

* ``one process``: ``python bench/layouts.py --worker ...`` with ``--n`` simulated
  devices
  (``--xla_force_host_platform_device_count``), every rank in one process, as in the
  notebook;
* ``process per rank``: the same under ``jaxpg-run --nproc-per-node N``, one CPU device per
  process, XLA's gloo collectives between processes, as torch's layout.

Measured in each: an eager ``all_reduce`` (``AVG``, its input the previous call's output, so
already where it belongs) at 4 KB, 1 MB and 16 MB per rank, blocking on each result; and a
``DistributedDataParallel`` step (forward, backward, bucketed gradient all-reduce, Adam) of
a small MLP (64-256-256-10, the digits model, 64 samples per rank) and of a 6.3M-parameter
MLP (1024-2048-2048-10, 25 MB of gradients, 32 samples per rank). Each figure is the
median over repeats within a run (``bench/_rounds.py``; rank 0's clock; every call blocks
on its result).

The two layouts cannot share one process, so they are interleaved run by run: every round
starts one run of each, in alternating order, and the reported ratio is the median over
rounds of (process per rank) / (one process). The machine is small and shared with other
work: read the ratios, not the absolute times.

    python bench/layouts.py     # N = 2 ranks, 3 rounds: ~3 minutes on 2 cores
    python bench/layouts.py --rounds 5

Writes ``bench/results/layouts.json`` and prints a markdown table.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the shared helpers
if "--worker" in sys.argv and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
    n = sys.argv[sys.argv.index("--ranks") + 1] if "--ranks" in sys.argv else "2"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={n}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from _launch import RESULTS, launch  # noqa: E402
from _rounds import load_average, rotated, run_rounds  # noqa: E402

SIZES = {"4K": 4 << 10, "1M": 1 << 20, "16M": 16 << 20}
MODELS = {"ddp_small": ((64, 256, 256, 10), 64), "ddp_25MB": ((1024, 2048, 2048, 10), 32)}
LAYOUTS = ("one process", "process per rank")


def _median_time(fn, repeats: int, calls: int) -> float:
    """Median over ``repeats`` of the mean time of ``calls`` back-to-back blocking calls."""
    return run_rounds({"fn": fn}, repeats, iters=calls).medians()["fn"]


def worker(args: argparse.Namespace) -> None:
    """One run of one layout: times every figure and writes rank 0's to ``args.worker``."""
    import jax
    import jax.numpy as jnp
    import optax
    from _models import MLP, loss_fn, make_batch  # bench/ is sys.path[0]
    from flax import nnx

    import jaxpg
    from jaxpg.ddp import DistributedDataParallel

    jaxpg.init_process_group()
    world = jaxpg.GroupMember.WORLD
    n_local = len(world.local_members())
    out: dict[str, float] = {}

    for name, size in SIZES.items():
        shape = (size // 4,) if n_local == 1 else (n_local, size // 4)
        state = {"x": jnp.ones(shape, jnp.float32)}

        def call(state=state):
            state["x"] = jaxpg.all_reduce(state["x"], op=jaxpg.ReduceOp.AVG)
            state["x"].block_until_ready()

        for _ in range(3):
            call()
        jaxpg.barrier()
        calls = 20 if size <= 1 << 20 else 3
        out[f"all_reduce_{name}_ms"] = 1e3 * _median_time(call, args.repeats, calls)

    for name, (layers, per_rank) in MODELS.items():
        batch = make_batch(n_local * per_rank, seed=jaxpg.get_rank(), layers=layers)
        ddp = DistributedDataParallel(MLP(nnx.Rngs(0), layers), optax.adam(1e-3))

        def step(ddp=ddp, batch=batch, loss_fn=loss_fn):
            ddp.train_step(loss_fn, batch)
            jax.block_until_ready(ddp.params)

        for _ in range(2):
            step()
        jaxpg.barrier()
        out[f"{name}_step_ms"] = 1e3 * _median_time(step, args.repeats,
                                                    5 if name == "ddp_small" else 1)
    if jaxpg.get_rank() == 0:
        Path(args.worker).write_text(json.dumps(out))
    jaxpg.destroy_process_group()


def _run(layout: str, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.json")
        launch(__file__, ["--worker", path, "--ranks", args.n, "--repeats", args.repeats],
               nproc=None if layout == "one process" else args.n, env={"XLA_FLAGS": None},
               timeout=900, expect=[path], what=f"{layout} run")
        return json.loads(Path(path).read_text())


def table(result: dict) -> str:
    lines = [f"| N = {result['n']} ranks | one process ms | process per rank ms | ratio | "
             "ratio range |", "|---|---:|---:|---:|---:|"]
    labels = {f"all_reduce_{k}_ms": f"eager all_reduce, {k} per rank" for k in SIZES}
    labels.update({"ddp_small_step_ms": "DDP step, 64-256-256-10 MLP, 64 samples/rank",
                   "ddp_25MB_step_ms": "DDP step, 6.3M-param MLP, 32 samples/rank"})
    for key, label in labels.items():
        s = result["summary"][key]
        lines.append(f"| {label} | {s['one process']:.2f} | {s['process per rank']:.2f} | "
                     f"{s['ratio']:.2f}x | {s['ratio_min']:.2f}-{s['ratio_max']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", dest="n", type=int, default=2,
                   help="ranks: devices in one process, or processes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=7, help="timed repeats within a run")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(RESULTS / "layouts.json"))
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    start, load_before = time.perf_counter(), load_average()
    rounds = []
    for r in range(args.rounds):
        order = rotated(LAYOUTS, r)
        rounds.append({layout: _run(layout, args) for layout in order})
        print(f"round {r + 1}/{args.rounds}: {json.dumps(rounds[-1])}", flush=True)
    summary = {}
    for key in rounds[0]["one process"]:
        summary[key] = {
            layout: statistics.median(rd[layout][key] for rd in rounds) for layout in LAYOUTS}
        ratios = [rd["process per rank"][key] / rd["one process"][key] for rd in rounds]
        summary[key].update(ratio=statistics.median(ratios), ratio_min=min(ratios),
                            ratio_max=max(ratios))
    result = {
        "benchmark": "layouts",
        "command": f"python bench/layouts.py --ranks {args.n} --rounds "
                   f"{args.rounds} --repeats {args.repeats}",
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.platform()}, {os.cpu_count()} CPU cores shared with other work",
        "n": args.n,
        "ratio": "process per rank / one process per round: median, min, max over rounds "
                 "(> 1: one process faster)",
        "rounds": rounds,
        "summary": summary,
        "wall_s": time.perf_counter() - start,
        "load_average_before": load_before, "load_average_after": load_average(),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


# python -m bench layouts --quick: a short run, written under /tmp unless --out is given
QUICK_ARGS = ["--rounds", "1", "--repeats", "2"]

if __name__ == "__main__":
    main()
