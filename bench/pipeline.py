"""Pipeline executor benchmark: memory, compile time and step time per schedule.

Measures, for the jaxpg executor on ``p`` simulated CPU devices (default 4):

* peak memory from the compiled program's memory analysis (``temp_size_in_bytes``:
  the buffers the program allocates, including the activation and gradient slots, plus
  argument and output sizes) for GPipe, 1F1B and ZB-H1 at ``m`` in {8, 16, 32}, with a
  fixed microbatch size, so the batch grows with ``m``;
* compile time (lower + compile) at ``m = 64`` against ``m = 8`` (the scan over ticks
  keeps it flat);
* step time (median wall time of ``loss, grads``) at ``m = 8``;
* with ``--torch``: the same layer shapes and stage count with
  ``torch.distributed.pipelining`` (``ScheduleGPipe``, ``Schedule1F1B``), one process per
  stage over gloo on this machine's CPU, for a side-by-side step time.

Every block is ``x + W2 gelu(W1 x + b1) + b2`` (width ``--dim``, hidden ``4 * dim``); the
loss is the mean squared error on the last stage. Writes ``bench/results/pipeline.json``
and prints a markdown table.

    python bench/pipeline.py [--torch] [--dim 256] [--microbatch 16]
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from jaxpg.pipeline.buffer_plan import plan_buffers  # noqa: E402
from jaxpg.pipeline.executor import pipeline_value_and_grad  # noqa: E402
from jaxpg.pipeline.schedules import get_schedule  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "zb_h1")


def block(w, x):
    return x + jax.nn.gelu(x @ w["w1"] + w["b1"]) @ w["w2"] + w["b2"]


def mse(_, y, t):
    return jnp.mean((y - t) ** 2)


def make_params(p, d, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w1": jax.random.normal(k1, (p, d, 4 * d)) / np.sqrt(d),
        "b1": jnp.zeros((p, 4 * d)),
        "w2": jax.random.normal(k2, (p, 4 * d, d)) / np.sqrt(4 * d),
        "b2": jnp.zeros((p, d)),
    }


def jax_fn(name, p, m):
    mesh = Mesh(np.array(jax.devices()[:p]), ("pp",))

    def run(params, x, t):
        return pipeline_value_and_grad(
            block, mse, params, x, t, mesh=mesh, schedule=name, num_microbatches=m
        )

    return jax.jit(run)


def batch(m, b, d, seed=1):
    kx, kt = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (m * b, d)), jax.random.normal(kt, (m * b, d))


def measure_memory(args):
    rows = []
    params = make_params(args.stages, args.dim)
    for name in SCHEDULES:
        for m in (8, 16, 32):
            x, t = batch(m, args.microbatch, args.dim)
            analysis = jax_fn(name, args.stages, m).lower(params, x, t).compile()
            analysis = analysis.memory_analysis()
            plan = plan_buffers(get_schedule(name, args.stages, m))
            rows.append(
                {
                    "schedule": name,
                    "m": m,
                    "temp_bytes": analysis.temp_size_in_bytes,
                    "argument_bytes": analysis.argument_size_in_bytes,
                    "output_bytes": analysis.output_size_in_bytes,
                    "act_slots": plan.num_act_slots,
                    "grad_slots": plan.num_grad_slots,
                }
            )
            print(f"memory {name} m={m}: temp {analysis.temp_size_in_bytes:,} B", flush=True)
    return rows


def measure_compile(args):
    rows = []
    params = make_params(args.stages, args.dim)
    for name in SCHEDULES:
        for m in (8, 64):
            x, t = batch(m, args.microbatch, args.dim)
            start = time.perf_counter()
            jax_fn(name, args.stages, m).lower(params, x, t).compile()
            seconds = time.perf_counter() - start
            rows.append({"schedule": name, "m": m, "compile_s": round(seconds, 3)})
            print(f"compile {name} m={m}: {seconds:.2f}s", flush=True)
    return rows


def measure_steps(args, m=8):
    rows = []
    params = make_params(args.stages, args.dim)
    x, t = batch(m, args.microbatch, args.dim)
    for name in SCHEDULES:
        fn = jax_fn(name, args.stages, m)
        jax.block_until_ready(fn(params, x, t))
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(params, x, t))
            times.append(time.perf_counter() - start)
        ms = 1e3 * statistics.median(times)
        rows.append({"framework": "jax (jaxpg)", "schedule": name, "m": m, "step_ms": ms})
        print(f"step {name} m={m}: {ms:.1f} ms", flush=True)
    return rows


def _torch_worker(rank, world, args, m, result_path, port):
    """One pipeline stage in its own process (torch.distributed.pipelining over gloo)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )

    class Block(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    torch.manual_seed(rank)
    d, b = args.dim, args.microbatch
    stage = PipelineStage(Block(d), rank, world, torch.device("cpu"))
    x, t = torch.randn(m * b, d), torch.randn(m * b, d)
    times = {}
    for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        schedule = cls(stage, n_microbatches=m, loss_fn=torch.nn.functional.mse_loss)
        samples = []
        for i in range(args.repeats + 2):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=t, losses=[])
            else:
                schedule.step()
            dist.barrier()
            if i >= 2:
                samples.append(time.perf_counter() - start)
        times[name] = 1e3 * statistics.median(samples)
    if rank == 0:
        Path(result_path).write_text(json.dumps(times))
    dist.destroy_process_group()


def torch_step_times(args, m=8):
    """Step times of torch.distributed.pipelining's GPipe and 1F1B, same shapes."""
    import socket
    import tempfile

    import torch
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "torch.json")
        mp.spawn(_torch_worker, args=(args.stages, args, m, path, port), nprocs=args.stages)
        times = json.loads(Path(path).read_text())
    rows = []
    for name, ms in times.items():
        framework = f"torch {torch.__version__} pipelining"
        rows.append({"framework": framework, "schedule": name, "m": m, "step_ms": ms})
        print(f"torch step {name} m={m}: {ms:.1f} ms", flush=True)
    return rows


def table(result):
    lines = ["| schedule | m | temp bytes | act slots | grad slots |", "|---|---|---|---|---|"]
    for r in result["memory"]:
        lines.append(
            f"| {r['schedule']} | {r['m']} | {r['temp_bytes']:,} | {r['act_slots']} "
            f"| {r['grad_slots']} |"
        )
    lines += ["", "| schedule | compile m=8 (s) | compile m=64 (s) |", "|---|---|---|"]
    compile_s = {(r["schedule"], r["m"]): r["compile_s"] for r in result["compile"]}
    for name in SCHEDULES:
        lines.append(f"| {name} | {compile_s[(name, 8)]:.2f} | {compile_s[(name, 64)]:.2f} |")
    lines += ["", "| framework | schedule | m | step (ms) |", "|---|---|---|---|"]
    for r in result["steps"]:
        lines.append(f"| {r['framework']} | {r['schedule']} | {r['m']} | {r['step_ms']:.1f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description="Pipeline executor benchmark.")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--microbatch", type=int, default=16, help="rows per microbatch")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--torch", action="store_true", help="add torch.distributed.pipelining")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "pipeline.json"))
    args = parser.parse_args()

    result = {
        "config": {
            "stages": args.stages,
            "dim": args.dim,
            "hidden": 4 * args.dim,
            "microbatch_rows": args.microbatch,
            "devices": f"{args.stages} simulated CPU devices",
            "cpu_count": os.cpu_count(),
            "jax": jax.__version__,
            "python": platform.python_version(),
        },
        "memory": measure_memory(args),
        "compile": measure_compile(args),
        "steps": measure_steps(args),
    }
    if args.torch:
        result["steps"] += torch_step_times(args)
        result["config"]["torch"] = "torch.distributed.pipelining, gloo, one process per stage"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
