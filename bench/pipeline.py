"""Pipeline executor benchmark: memory, compile time, step time, efficiency, torch.

The model is ``--blocks`` (default 8) residual MLP blocks ``x + W2 gelu(W1 x + b1) + b2``
(width ``--dim``, hidden ``4 * dim``) and a mean squared error, cut into ``p * v``
pipeline stages of ``blocks / (p v)`` blocks each, so every schedule runs the same model.

* ``memory``: XLA's compiled memory analysis (``temp_size_in_bytes``: the buffers the
  program allocates, slots and residuals included) for each schedule with ``remat`` off
  and on, at ``m`` in {8, 16, 32} and a fixed microbatch size.
* ``compile``: lower + compile at ``m = 64`` against ``m = 8``.
* ``steps``: step time (``loss, grads``) on ``--stages`` simulated CPU devices, every
  variant run side by side: each round runs every variant once, in turn, and the
  ratios are taken within a round; the tables give medians over ``--rounds`` rounds.
  ``grad_check`` records that the variants' gradients agree, and each row's
  ``loop_matmuls`` the matmuls of its compiled loop (``loop_matmuls``): the work check
  beside the time, since a path that recomputes a forward holds more of them (1F1B
  and ZB-H1 without remat hold the same number, 3 per forward matmul).
* ``remat``: 1F1B with ``remat`` off against on, for stages of one and of two blocks,
  side by side, with the matmuls of one microbatch's F + B counted in the compiled loop
  (their ratio is the best the step-time ratio can be), and the same ratio for the stage
  alone on one device, without the pipeline (``stage_work``: what the executor adds).
* ``--efficiency``: in a subprocess with 2 simulated devices and single-threaded XLA
  CPU kernels (one device per core on a 2-core machine), step time of every schedule
  at ``p = 2`` against the bound ``T1 (m + p - 1) / (m p)``
  (``jaxpg.pipeline.schedule.costs.ideal_step_time``), ``T1`` the un-pipelined step of the same
  model and batch on one device.
* ``--torch``: ``torch.distributed.pipelining`` (``ScheduleGPipe``, ``Schedule1F1B``,
  ``ScheduleInterleaved1F1B``, ``ScheduleZBVZeroBubble``) on the same model, stage count
  and microbatches, one CPU process per rank over gloo, one thread each.

Writes ``bench/results/pipeline.json`` (``--configuration NAME``: as that named run
inside it, ``bench/_results.py``) and prints markdown tables.

    python bench/pipeline.py [--efficiency] [--torch] [--dim 512] [--microbatch 16]
    python bench/pipeline.py --skip-memory --variants "1f1b remat,1f1b,zb_h1 remat,zb_h1" \
        --configuration remat_and_zb_h1     # keeping residuals and ZB-H1, side by side
"""

import os
import sys

_WORKER = "--efficiency-worker" in sys.argv
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + (
        " --xla_force_host_platform_device_count=2 --xla_cpu_multi_thread_eigen=false"
        if _WORKER
        else " --xla_force_host_platform_device_count=8"
    )
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _launch import RESULTS, free_port, launch  # noqa: E402  (bench/ is sys.path[0])
from _residual_mlp import make_params, mse, stage_fn, staged, torch_block, unstaged  # noqa: E402
from _results import add_flag, save  # noqa: E402
from _rounds import load_average, ratio_median, run_rounds  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxpg.pipeline.api import pipeline_value_and_grad  # noqa: E402
from jaxpg.pipeline.lockstep.buffer_plan import plan_buffers  # noqa: E402
from jaxpg.pipeline.lockstep.hlo_loop import count_in_loop  # noqa: E402
from jaxpg.pipeline.param_placement import place_pipeline_params  # noqa: E402
from jaxpg.pipeline.schedule.builders import get_schedule, one_f_one_b  # noqa: E402
from jaxpg.pipeline.schedule.costs import ideal_step_time  # noqa: E402
from jaxpg.pipeline.stage.order import to_model_order, to_rank_order  # noqa: E402
from jaxpg.pipeline.stage.split import split_stage  # noqa: E402

CHUNKS = {"gpipe": 1, "1f1b": 1, "zb_h1": 1, "interleaved_1f1b": 2, "zb_v": 2}
# "1f1b_split": 1F1B with each backward run as B then W (one_f_one_b(split_backward=True)).
SPLIT_1F1B = "1f1b_split"
# Two chunks per rank run on stage stacks in rank order (``to_rank_order``), as the
# README advises; this suffix runs one on a model-order stack, resharded by every call.
MODEL_ORDER = " (model order)"
# (schedule, remat) run side by side in the step-time rounds.
STEP_VARIANTS = [  # the first is every gradient check's reference
    ("1f1b", True), ("gpipe", False), ("1f1b", False), ("zb_h1", True), ("zb_h1", False),
    ("interleaved_1f1b", False), ("zb_v", False), (SPLIT_1F1B, False),
    ("zb_v" + MODEL_ORDER, False),
]  # fmt: skip


def label(name, remat):
    return f"{name} remat" if remat else name


def mesh_of(p):
    return Mesh(np.array(jax.devices()[:p]), ("pp",))


def timetable(name, p, m):
    """The timetable of ``name`` (a schedule name, ``SPLIT_1F1B``, maybe + ``MODEL_ORDER``)."""
    name = name.removesuffix(MODEL_ORDER)
    if name == SPLIT_1F1B:
        return one_f_one_b(p, m, split_backward=True)
    return get_schedule(name, p, m, CHUNKS[name])


def stage_order(name):
    return "model" if name.endswith(MODEL_ORDER) else "rank"


def jax_fn(name, p, m, layers, remat):
    mesh = mesh_of(p)
    schedule = timetable(name, p, m)

    def run(params, x, t):
        return pipeline_value_and_grad(
            stage_fn(layers), mse, params, x, t, mesh=mesh, schedule=schedule,
            num_microbatches=m, remat=remat, stage_order=stage_order(name),
        )  # fmt: skip

    return jax.jit(run)


def batch(m, b, d, seed=1):
    kx, kt = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (m * b, d)), jax.random.normal(kt, (m * b, d))


def setup(args, name, remat, m, p=None):
    """The jitted step of schedule ``name`` and its parameters, placed on the mesh as
    ``make_train_step`` keeps them between steps (``place_pipeline_params``), so that a
    step does not start by moving the parameters from one device to all of them."""
    p = p or args.stages
    tt = timetable(name, p, m)
    v = tt.num_chunks
    params = staged(make_params(args.blocks, args.dim), p * v)
    if stage_order(name) == "rank":
        params = to_rank_order(params, tt)
    params = place_pipeline_params(params, mesh_of(p))
    return jax_fn(name, p, m, args.blocks // (p * v), remat), params


def placed_batch(m, b, d, p):
    """``batch(...)`` replicated over the ``p`` pipeline devices (where the step reads it)."""
    return jax.device_put(batch(m, b, d), NamedSharding(mesh_of(p), P()))


def measure_memory(args):
    rows = []
    for name in ("gpipe", "1f1b", "zb_h1", "zb_v"):
        for remat in (False, True):
            for m in (8, 16, 32):
                fn, params = setup(args, name, remat, m)
                x, t = batch(m, args.microbatch, args.dim)
                analysis = fn.lower(params, x, t).compile().memory_analysis()
                plan = plan_buffers(get_schedule(name, args.stages, m, CHUNKS[name]))
                rows.append({
                    "schedule": label(name, remat), "name": name, "remat": remat, "m": m,
                    "temp_bytes": analysis.temp_size_in_bytes,
                    "argument_bytes": analysis.argument_size_in_bytes,
                    "output_bytes": analysis.output_size_in_bytes,
                    "act_slots": plan.num_act_slots, "grad_slots": plan.num_grad_slots,
                })  # fmt: skip
                print(f"memory {label(name, remat)} m={m}: temp "
                      f"{analysis.temp_size_in_bytes:,} B", flush=True)  # fmt: skip
    return rows


def measure_compile(args):
    rows = []
    for name in ("1f1b", "zb_h1", "zb_v"):
        for m in (8, 64):
            fn, params = setup(args, name, False, m)
            x, t = batch(m, args.microbatch, args.dim)
            start = time.perf_counter()
            fn.lower(params, x, t).compile()
            seconds = time.perf_counter() - start
            rows.append({"schedule": name, "m": m, "compile_s": round(seconds, 3)})
            print(f"compile {name} m={m}: {seconds:.2f}s", flush=True)
    return rows


def side_by_side(fns, rounds, cpu=None):
    """Runs every ``fns[key]()`` once per round (``bench/_rounds.py``: a warm-up call
    each, then the rounds in a rotating order); returns the samples per key.

    Wall-clock seconds; if ``cpu`` is a dict, it receives the process CPU seconds of each
    run too (all threads: on a shared, oversubscribed machine this is the work done,
    whatever other jobs do to the wall clock).
    """
    timed = run_rounds(fns, rounds, warmup=1)
    if cpu is not None:
        cpu.update(timed.cpu)
    return timed.wall


def minor_faults_per_call(fn, calls=3):
    """Page faults (minor: fresh memory touched) per call of ``fn``, after a warm call.

    XLA:CPU allocates a program's temp buffer on every call; memory that comes fresh
    from the kernel is faulted in page by page, work that shows in the step time.
    """
    jax.block_until_ready(fn())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        jax.block_until_ready(fn())
    return round((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls)


def measure_steps(args, m=8):
    x, t = placed_batch(m, args.microbatch, args.dim, args.stages)
    fns, grads, names, matmuls = {}, {}, {}, {}
    chosen = args.variants.split(",") if args.variants else None
    for name, remat in STEP_VARIANTS:
        if chosen is not None and label(name, remat) not in chosen:
            continue
        fn, params = setup(args, name, remat, m)
        fns[label(name, remat)] = functools.partial(fn, params, x, t)
        names[label(name, remat)] = name
        matmuls[label(name, remat)] = loop_matmuls(fn.lower(params, x, t).compile().as_text())
    cpu = {}
    samples = side_by_side(fns, args.rounds, cpu)
    faults = {key: minor_faults_per_call(fn) for key, fn in fns.items()}
    for key, fn in fns.items():
        loss, g = fn()
        if stage_order(names[key]) == "rank":
            g = to_model_order(g, timetable(names[key], args.stages, m))
        grads[key] = (float(loss), jax.tree.map(lambda a: np.asarray(a).reshape(-1), unstaged(g)))

    def max_diff(a, b):
        la, lb = jax.tree.leaves(grads[a][1]), jax.tree.leaves(grads[b][1])
        return max(float(np.max(np.abs(u - w))) for u, w in zip(la, lb, strict=True))

    def ratio(a, b, table=samples):
        return ratio_median(table[a], table[b])

    rows = [
        {"framework": "jax (jaxpg)", "schedule": key, "m": m,
         "step_ms": 1e3 * statistics.median(s), "cpu_ms": 1e3 * statistics.median(cpu[key]),
         "minor_faults": faults[key], "loop_matmuls": matmuls[key],
         "samples_ms": [round(1e3 * v, 2) for v in s],
         "cpu_samples_ms": [round(1e3 * v, 2) for v in cpu[key]]}
        for key, s in samples.items()
    ]  # fmt: skip
    for r in rows:
        print(f"step {r['schedule']} m={m}: {r['step_ms']:.1f} ms wall, "
              f"{r['cpu_ms']:.1f} ms CPU, {r['minor_faults']} page faults, "
              f"{r['loop_matmuls']} matmuls in the loop", flush=True)  # fmt: skip
    pairs = {
        "zb_h1 / 1f1b": ("zb_h1", "1f1b"),
        "1f1b / 1f1b remat": ("1f1b", "1f1b remat"),
        "zb_h1 / zb_h1 remat": ("zb_h1", "zb_h1 remat"),
        "zb_v / 1f1b": ("zb_v", "1f1b"),
        "interleaved_1f1b / 1f1b": ("interleaved_1f1b", "1f1b"),
        "1f1b_split / 1f1b": (SPLIT_1F1B, "1f1b"),
        "zb_v, model order / rank order": ("zb_v" + MODEL_ORDER, "zb_v"),
    }
    pairs = {k: ab for k, ab in pairs.items() if set(ab) <= set(fns)}  # with --variants
    ratios = {k: ratio(a, b) for k, (a, b) in pairs.items()}
    ratios.update({f"{k} (CPU time)": ratio(a, b, cpu) for k, (a, b) in pairs.items()})
    first = next(iter(fns))
    check = {f"{key} vs {first}: max |grad diff|": max_diff(key, first) for key in fns}
    check["max |grad|"] = max(float(np.max(np.abs(a))) for a in jax.tree.leaves(grads[first][1]))
    print(json.dumps({"ratios (median of per-round ratios)": ratios, **check}, indent=1))
    return rows, ratios, check


def loop_matmuls(hlo):
    """Matmuls in the compiled pipeline loop, counted per call site: the ``dot``s of the
    while body and of what it calls (every branch of a conditional once, so for
    ``v = 1`` the count is the matmuls of one microbatch's F, B and W on one stage)."""
    return count_in_loop(hlo, " dot(")


def stage_work(args, layers, rounds, calls=8):
    """One stage's own work per microbatch on one device, without the pipeline: ``F`` that
    keeps residuals + the backward from them, against ``F`` + the backward that recomputes
    the stage (``jax.vjp``), each adding its weight gradient to an accumulator, as the
    executor does. Returns the median per-round ratios of wall and CPU seconds: what the
    step-time ratio would be if the executor added nothing."""
    params = jax.tree.map(lambda a: a[0], staged(make_params(layers, args.dim), 1))
    stage = stage_fn(layers)
    kx, kd = jax.random.split(jax.random.key(2))
    x = jax.random.normal(kx, (args.microbatch, args.dim))
    dy = jax.random.normal(kd, (args.microbatch, args.dim))
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, x))
    pieces = split_stage(stage, *shapes, split_backward=False)

    def accumulate(g, grads):
        return jax.tree.map(jnp.add, g, grads[0]), grads[1]

    f_keep = jax.jit(pieces.forward)
    b_keep = jax.jit(lambda g, p, x, dy, res: accumulate(g, pieces.backward(p, x, dy, res)[:2]),
                     donate_argnums=0)
    f_remat = jax.jit(stage)
    b_remat = jax.jit(lambda g, p, x, dy: accumulate(g, jax.vjp(stage, p, x)[1](dy)),
                      donate_argnums=0)

    def keep(acc):
        for _ in range(calls):
            _, res = f_keep(params, x)
            acc[0], _ = b_keep(acc[0], params, x, dy, res)
        return acc[0]

    def recompute(acc):
        for _ in range(calls):
            f_remat(params, x)
            acc[0], _ = b_remat(acc[0], params, x, dy)
        return acc[0]

    accs = {k: [jax.tree.map(jnp.zeros_like, params)] for k in ("keep", "remat")}
    cpu = {}
    wall = side_by_side({"keep": lambda: keep(accs["keep"]),
                         "remat": lambda: recompute(accs["remat"])}, rounds, cpu)
    return {kind: ratio_median(t["keep"], t["remat"]) for kind, t in (("wall", wall), ("cpu", cpu))}


def measure_remat(args, m=8):
    """1F1B with and without remat, stages of 1 and of 2 blocks, side by side."""
    x, t = placed_batch(m, args.microbatch, args.dim, args.stages)
    fns, matmuls = {}, {}
    for layers in (1, 2):
        for remat in (True, False):
            key = f"{layers} block{'s' if layers > 1 else ''}/stage, {label('1f1b', remat)}"
            params = place_pipeline_params(
                staged(make_params(layers * args.stages, args.dim), args.stages),
                mesh_of(args.stages))
            fn = jax_fn("1f1b", args.stages, m, layers, remat)
            matmuls[key] = loop_matmuls(fn.lower(params, x, t).compile().as_text())
            fns[key] = functools.partial(fn, params, x, t)
    cpu = {}
    samples = side_by_side(fns, args.rounds, cpu)
    grads = {k: jax.tree.leaves(fn()[1]) for k, fn in fns.items()}
    rows = []
    for layers in (1, 2):
        blocks = f"{layers} block{'s' if layers > 1 else ''}/stage"
        a, b = f"{blocks}, 1f1b", f"{blocks}, 1f1b remat"
        rows.append({
            "stage": blocks, "matmuls": matmuls[a], "matmuls_remat": matmuls[b],
            "theory": matmuls[a] / matmuls[b],
            "wall_ratio": ratio_median(samples[a], samples[b]),
            "cpu_ratio": ratio_median(cpu[a], cpu[b]),
            "step_ms": 1e3 * statistics.median(samples[a]),
            "step_ms_remat": 1e3 * statistics.median(samples[b]),
            "max_grad_diff": max(float(jnp.max(jnp.abs(u - w)))
                                 for u, w in zip(grads[a], grads[b], strict=True)),
        })  # fmt: skip
        alone = stage_work(args, layers, args.rounds)
        rows[-1].update(stage_alone_wall_ratio=alone["wall"], stage_alone_cpu_ratio=alone["cpu"])
        r = rows[-1]
        print(f"remat {blocks}: stage alone wall {alone['wall']:.3f}, CPU {alone['cpu']:.3f}")
        print(f"remat {blocks}: matmuls {matmuls[a]} vs {matmuls[b]}, wall "
              f"{r['wall_ratio']:.3f}, CPU {r['cpu_ratio']:.3f}", flush=True)  # fmt: skip
    return rows


def efficiency_worker(args, m=8, p=2):
    """Runs in a subprocess with 2 single-threaded simulated devices; prints JSON."""
    x, t = batch(m, args.microbatch, args.dim)
    params = jax.tree.map(lambda a: a[0], staged(make_params(args.blocks, args.dim), 1))
    one = jax.jit(jax.value_and_grad(lambda w, x, t: mse(None, stage_fn(args.blocks)(w, x), t)))
    fns = {"un-pipelined, 1 device": functools.partial(one, params, x, t)}
    for name in CHUNKS:
        fn, sp = setup(args, name, False, m, p=p)
        fns[name] = functools.partial(fn, sp, x, t)
    samples = side_by_side(fns, args.rounds)
    t1 = samples["un-pipelined, 1 device"]
    rows = []
    for key, s in samples.items():
        ideal = [ideal_step_time(a, p, m) for a in t1]
        rows.append({
            "schedule": key, "p": p, "m": m, "step_ms": 1e3 * statistics.median(s),
            "efficiency": statistics.median(i / x for i, x in zip(ideal, s, strict=True)),
        })  # fmt: skip
    print("EFFICIENCY " + json.dumps(rows))


def measure_efficiency(args):
    # one plain process of its own: 2 single-threaded simulated devices (its XLA flags)
    done = launch(__file__, ["--efficiency-worker", "--dim", args.dim, "--microbatch",
                             args.microbatch, "--rounds", args.rounds, "--blocks", args.blocks])
    out = done.output or ""
    rows = json.loads(next(ln for ln in out.splitlines() if ln.startswith("EFFICIENCY "))[11:])
    for r in rows:
        print(f"efficiency {r['schedule']}: {r['step_ms']:.1f} ms, {r['efficiency']:.2f}")
    return rows


def _torch_worker(rank, world, args, m, result_path, port):
    """One pipeline rank in its own process (torch.distributed.pipelining over gloo)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )

    def stage(index, num_stages):
        layers = args.blocks // num_stages
        torch.manual_seed(index)
        module = torch.nn.Sequential(*[torch_block(args.dim) for _ in range(layers)])
        return PipelineStage(module, index, num_stages, torch.device("cpu"))

    d, b, p = args.dim, args.microbatch, world
    x, t = torch.randn(m * b, d), torch.randn(m * b, d)
    schedules = {
        "gpipe": (ScheduleGPipe, [rank], p),
        "1f1b": (Schedule1F1B, [rank], p),
        "interleaved_1f1b": (ScheduleInterleaved1F1B, [rank, rank + p], 2 * p),
        "zb_v": (ScheduleZBVZeroBubble, [rank, 2 * p - 1 - rank], 2 * p),
    }
    times = {}
    for name, (cls, indices, num_stages) in schedules.items():
        stages = [stage(i, num_stages) for i in indices]
        arg = stages[0] if len(stages) == 1 else stages
        schedule = cls(arg, n_microbatches=m, loss_fn=torch.nn.functional.mse_loss)
        first, last = 0 in indices, num_stages - 1 in indices

        def step(schedule=schedule, first=first, last=last):
            kwargs = {"target": t, "losses": []} if last else {}
            if first:
                schedule.step(x, **kwargs)
            else:
                schedule.step(**kwargs)
            dist.barrier()  # inside the timing: the step ends when the last rank's does

        timed = run_rounds({name: step}, args.rounds, warmup=2, barrier=dist.barrier)
        times[name] = 1e3 * timed.medians()[name]
    if rank == 0:
        Path(result_path).write_text(json.dumps(times))
    dist.destroy_process_group()


def torch_step_times(args, m=8):
    """Step times of torch.distributed.pipelining on the same model, stages and m."""
    import tempfile

    import torch
    import torch.multiprocessing as mp

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "torch.json")
        # torch's own spawn, not bench/_launch.launch: torch's pipelining as torch users
        # start it (no jaxpg world, no jaxpg-run CPU pinning), the worker a function here
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
    for name in sorted({k[0] for k in compile_s}):
        lines.append(f"| {name} | {compile_s[(name, 8)]:.2f} | {compile_s[(name, 64)]:.2f} |")
    lines += ["", "| framework | schedule | m | step (ms) |", "|---|---|---|---|"]
    for r in result["steps"]:
        lines.append(f"| {r['framework']} | {r['schedule']} | {r['m']} | {r['step_ms']:.1f} |")
    lines += ["", "| ratio (median over rounds) | value |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in result["ratios"].items()]
    if "remat" in result:
        lines += ["", "| 1F1B, stage of | matmuls (no remat / remat) | theory | wall | CPU "
                  "| stage alone: wall | stage alone: CPU |",
                  "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in result["remat"]:
            lines.append(f"| {r['stage']} | {r['matmuls']} / {r['matmuls_remat']} | "
                         f"{r['theory']:.3f} | {r['wall_ratio']:.3f} | {r['cpu_ratio']:.3f} | "
                         f"{r['stage_alone_wall_ratio']:.3f} | {r['stage_alone_cpu_ratio']:.3f} |")
    if "efficiency" in result:
        lines += ["", "| schedule (p=2, m=8) | step (ms) | efficiency |", "|---|---|---|"]
        lines += [f"| {r['schedule']} | {r['step_ms']:.1f} | {r['efficiency']:.2f} |"
                  for r in result["efficiency"]]  # fmt: skip
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description="Pipeline executor benchmark.")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=8, help="MLP blocks in the model")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--microbatch", type=int, default=64, help="rows per microbatch")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--torch", action="store_true", help="add torch.distributed.pipelining")
    parser.add_argument("--efficiency", action="store_true", help="p=2 against the bound")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-remat", action="store_true", help="skip the 1 vs 2 block study")
    parser.add_argument("--variants", default="",
                        help="step-time variants to run, comma-separated labels such as "
                             "'1f1b,zb_h1,1f1b remat' (default: all)")  # fmt: skip
    parser.add_argument("--efficiency-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS / "pipeline.json"))
    add_flag(parser)
    args = parser.parse_args()
    if args.efficiency_worker:
        efficiency_worker(args)
        return

    result = {
        "config": {
            "stages": args.stages, "blocks": args.blocks, "dim": args.dim,
            "hidden": 4 * args.dim, "microbatch_rows": args.microbatch,
            "rounds": args.rounds, "variants": args.variants or "all",
            "devices": f"{args.stages} simulated CPU devices, one process",
            "cpu_count": os.cpu_count(), "jax": jax.__version__,
            "python": platform.python_version(),
            "note": "2-core machine shared with other jobs; compare ratios, not absolutes",
            "load_average_before": load_average(),
        },  # fmt: skip
    }
    if not args.skip_memory:
        result["memory"] = measure_memory(args)
        result["compile"] = measure_compile(args)
    result["steps"], result["ratios"], result["grad_check"] = measure_steps(args)
    if not args.skip_remat:
        result["remat"] = measure_remat(args)
    if args.efficiency:
        result["efficiency"] = measure_efficiency(args)
    if args.torch:
        result["steps"] += torch_step_times(args)
        result["config"]["torch"] = "torch.distributed.pipelining, gloo, one process per rank"
    result["config"]["load_average_after"] = load_average()
    save(args.out, result, args.configuration)
    if not args.skip_memory:
        print(table(result))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
