"""One pipeline rank of ``bench/pipeline_efficiency.py`` / ``bench/pipeline_vs_torch.py``.

Started by ``jaxpg-run --nproc-per-node p`` (not run by hand): one process per pipeline
rank, each pinned by the launcher to its own CPU core (so XLA:CPU runs one intra-op
thread), one CPU device per process, the pipeline's ``ppermute`` over gloo between the
processes. In the same processes, every round runs, in a rotating order:

* ``baseline``: the un-pipelined step (``jax.value_and_grad`` of the whole model, the
  whole batch) on rank 0's one device, one core, while the other ranks wait (with
  ``--torch``, also ``torch baseline``: the same in torch, one thread), and
  ``baseline_microbatched``: the same, run microbatch by microbatch (``lax.scan``);
* ``jaxpg <schedule> m=<m>``: ``pipeline_value_and_grad`` over the ``p`` processes;
* with ``--torch``: ``torch <Schedule class> m=<m>`` (``torch.distributed.pipelining``
  over a gloo group of the same processes, ``torch.set_num_threads(1)``), the same model,
  weights, stage split, microbatches and batch.

Before timing, every jaxpg variant's gradients are checked against the un-pipelined
reference (and, given ``--reference``, against the single-process pipeline's gradients
on ``p`` simulated devices), and every torch schedule's loss and gradients against
jaxpg's on the same weights. Rank 0 writes the per-round times (each the slowest rank's,
between two barriers) as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from _residual_mlp import (  # noqa: F401  (the studies import the model from here too)
    block,
    make_batch,
    make_params,
    mse,
    per_block,
    stacked,
    stage_fn,
    staged,
    torch_block,
    unstaged,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# Chunks (model stages per rank) of each jaxpg schedule.
CHUNKS = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 1, "zb_v": 2}
# torch class -> (chunks, stage indices of rank r for p ranks).
TORCH = {
    "ScheduleGPipe": (1, lambda r, p: [r]),
    "Schedule1F1B": (1, lambda r, p: [r]),
    "ScheduleInterleaved1F1B": (2, lambda r, p: [r, r + p]),
    "ScheduleInterleavedZeroBubble": (2, lambda r, p: [r, r + p]),
    "ScheduleZBVZeroBubble": (2, lambda r, p: [r, 2 * p - 1 - r]),
}


def un_pipelined(blocks):
    """The reference step: loss and gradient of the whole model on the whole batch
    (the mean of the microbatch losses equals the whole-batch mean: equal microbatches),
    over ``per_block`` parameters."""
    return jax.jit(jax.value_and_grad(lambda w, x, t: mse(None, stage_fn(blocks)(w, x), t)))


def microbatched(blocks, m):
    """The un-pipelined model run microbatch by microbatch in one program (the ``m``
    microbatches unrolled, gradients summed), over ``per_block`` parameters: the same
    matmul sizes as the pipeline's, on one core. Unrolled: a ``lax.scan`` over the
    microbatches runs slower on XLA:CPU (as over the layers,
    ``bench/stage_layer_layout.py``)."""

    def run(w, x, t):
        xs, ts = (a.reshape(m, -1, a.shape[-1]) for a in (x, t))
        vg = jax.value_and_grad(lambda w, x, t: mse(None, stage_fn(blocks)(w, x), t))
        total = vg(w, xs[0], ts[0])
        for i in range(1, m):
            total = jax.tree.map(jnp.add, total, vg(w, xs[i], ts[i]))
        return jax.tree.map(lambda a: a / m, total)

    return jax.jit(run)


def jaxpg_step(name, mesh, m, layers, stage_order="model", executor="spmd"):
    """jaxpg's pipeline step: ``executor="spmd"`` (lockstep, one jitted program) or
    ``"mpmd"`` (the process executor, run from host code)."""
    from jaxpg.pipeline import pipeline_value_and_grad

    def run(params, x, t):
        return pipeline_value_and_grad(
            stage_fn(layers), mse, params, x, t, mesh=mesh, schedule=name, num_microbatches=m,
            stage_order=stage_order, executor=executor,
        )  # fmt: skip

    return run if executor == "mpmd" else jax.jit(run)


def gather(tree):
    from jax.experimental import multihost_utils

    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def max_rel_diff(a, b):
    """max |a - b| over all leaves, relative to the largest |b| entry."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    scale = max(float(np.max(np.abs(x))) for x in lb)
    return max(float(np.max(np.abs(np.reshape(x, -1) - np.reshape(y, -1))))
               for x, y in zip(la, lb, strict=True)) / scale  # fmt: skip


def torch_variant(cls_name, rank, p, m, params, x, t):
    """A torch pipeline schedule on this rank's stages; returns (step, check).

    ``cls_name="baseline"``: the whole model un-pipelined on this process (check None).
    """
    import torch
    import torch.distributed.pipelining as pipelining

    blocks = params["w1"].shape[0]

    if cls_name in ("baseline", "baseline_microbatched"):  # un-pipelined, on this process
        model = torch.nn.Sequential(*[torch_block(w=w) for w in per_block(params)])
        tx, tt = torch.from_numpy(x.copy()), torch.from_numpy(t.copy())

        def whole():
            model.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(tx), tt).backward()

        def by_microbatch():  # the pipeline's matmul sizes; .grad accumulates
            model.zero_grad(set_to_none=True)
            for xi, ti in zip(tx.chunk(m), tt.chunk(m), strict=True):
                (torch.nn.functional.mse_loss(model(xi), ti) / m).backward()

        return (whole if cls_name == "baseline" else by_microbatch), None

    chunks, indices_of = TORCH[cls_name]
    num_stages, indices = chunks * p, indices_of(rank, p)
    layers = blocks // num_stages
    modules, stages = {}, []
    for s in indices:
        ws = [{k: a[s * layers + i] for k, a in params.items()} for i in range(layers)]
        modules[s] = torch.nn.Sequential(*[torch_block(w=w) for w in ws])
        stages.append(pipelining.PipelineStage(modules[s], s, num_stages, torch.device("cpu")))
    schedule = getattr(pipelining, cls_name)(
        stages[0] if chunks == 1 else stages, n_microbatches=m,
        loss_fn=torch.nn.functional.mse_loss,
    )  # fmt: skip
    tx, tt = torch.from_numpy(x.copy()), torch.from_numpy(t.copy())
    first, last = 0 in indices, num_stages - 1 in indices

    def step():
        for mod in modules.values():
            mod.zero_grad(set_to_none=True)
        losses = []
        kwargs = {"target": tt, "losses": losses} if last else {}
        schedule.step(tx, **kwargs) if first else schedule.step(**kwargs)
        return losses

    def check():
        """(this rank's mean loss or None, {stage: {name: [layers, ...] grads}})."""
        losses = step()
        loss = float(torch.stack(losses).mean().detach()) if last else None
        grads = {}
        for s, mod in modules.items():
            grads[s] = {
                "w1": np.stack([b.up.weight.grad.numpy().T for b in mod]),
                "b1": np.stack([b.up.bias.grad.numpy() for b in mod]),
                "w2": np.stack([b.down.weight.grad.numpy().T for b in mod]),
                "b2": np.stack([b.down.bias.grad.numpy() for b in mod]),
            }
        return loss, grads

    return step, check


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--torch-port", type=int, required=True)
    ap.add_argument("--schedules", default=",".join(CHUNKS))
    ap.add_argument("--executors", default="spmd",
                    help="jaxpg executors to time: spmd (key 'jaxpg <schedule>'), mpmd "
                         "(key 'jaxpg-mpmd <schedule>')")  # fmt: skip
    ap.add_argument("--torch", default="", help="comma-separated torch schedule classes")
    ap.add_argument("--ms", default="4,8,16")
    ap.add_argument("--baseline", action="store_true", help="time the un-pipelined step")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--microbatch", type=int, default=64, help="rows per microbatch")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reference", default="", help="npz of single-process pipeline grads")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch.distributed as dist
    from _timing import join_both_worlds, leave_both_worlds, time_rounds

    from jaxpg.pipeline import get_schedule
    from jaxpg.pipeline.stage.order import to_model_order, to_rank_order

    rank, p = join_both_worlds(args.torch_port)
    mesh = Mesh(np.array(jax.devices()), ("pp",))
    local = jax.local_devices()[0]
    params = make_params(args.blocks, args.dim)
    ms = [int(v) for v in args.ms.split(",")]
    schedules = [s for s in args.schedules.split(",") if s]
    executors = [s for s in args.executors.split(",") if s]
    torch_names = [s for s in args.torch.split(",") if s]
    reference = dict(np.load(args.reference)) if args.reference else {}

    fns, checks = {}, {}
    ref_step = un_pipelined(args.blocks)
    local_params = jax.device_put(per_block(params), local)
    for m in ms:
        x, t = make_batch(m * args.microbatch, args.dim)
        lx, lt = jax.device_put(x, local), jax.device_put(t, local)
        ref_loss, ref_grads = ref_step(local_params, lx, lt)
        ref_loss, ref_grads = np.asarray(ref_loss), stacked(ref_grads)
        if args.baseline:
            # the un-pipelined step on rank 0 alone, and on every rank at once: what the
            # cores give when all of them are busy (shared caches, memory bandwidth, two
            # ranks to a core at p = 4)
            fns[f"baseline m={m}"] = functools.partial(ref_step, local_params, lx, lt) if (
                rank == 0) else lambda: None  # fmt: skip
            fns[f"baseline_every_rank m={m}"] = functools.partial(ref_step, local_params, lx, lt)
            mb_step = microbatched(args.blocks, m)
            key = f"baseline_microbatched m={m}"
            fns[key] = functools.partial(mb_step, local_params, lx, lt) if rank == 0 else (
                lambda: None)  # fmt: skip
            loss, grads = mb_step(local_params, lx, lt)
            loss, grads = np.asarray(loss), stacked(grads)
            checks[key] = {"loss": float(loss), "vs_un_pipelined": max_rel_diff(grads, ref_grads),
                           "loss_vs_un_pipelined": abs(float(loss) - float(ref_loss))}  # fmt: skip
        if args.baseline and torch_names:
            whole = torch_variant("baseline", rank, p, m, params, x, t)[0]
            fns[f"torch baseline m={m}"] = whole if rank == 0 else lambda: None
            fns[f"torch baseline_every_rank m={m}"] = whole
            by_mb = torch_variant("baseline_microbatched", rank, p, m, params, x, t)[0]
            fns[f"torch baseline_microbatched m={m}"] = by_mb if rank == 0 else lambda: None
        gx, gt = (jax.device_put(a, NamedSharding(mesh, P())) for a in (x, t))
        for name in schedules:
            v = CHUNKS[name]
            # two chunks per rank: the stacks in rank order, so no step reshards them
            tt = get_schedule(name, p, m, v)
            sp = jax.device_put(to_rank_order(staged(params, p * v), tt),
                                NamedSharding(mesh, P("pp")))
            for executor in executors:
                fn = jaxpg_step(name, mesh, m, args.blocks // (p * v), stage_order="rank",
                                executor=executor)  # fmt: skip
                key = f"jaxpg{'-mpmd' if executor == 'mpmd' else ''} {name} m={m}"
                fns[key] = functools.partial(fn, sp, gx, gt)
                loss, grads = fn(sp, gx, gt)
                grads = unstaged(to_model_order(gather(grads), tt))
                checks[key] = {"loss": float(loss),
                               "vs_un_pipelined": max_rel_diff(grads, ref_grads),
                               "loss_vs_un_pipelined": abs(float(loss) - float(ref_loss))}
                if f"{name} m={m} w1" in reference:
                    single = {k: reference[f"{name} m={m} {k}"] for k in grads}
                    checks[key]["vs_single_process"] = max_rel_diff(grads, single)
        for cls_name in torch_names:
            step, check = torch_variant(cls_name, rank, p, m, params, x, t)
            key = f"torch {cls_name} m={m}"
            fns[key] = step
            loss, grads = check()
            everyone = [None] * p
            dist.all_gather_object(everyone, (loss, grads))
            layers = args.blocks // len({s for _, g in everyone for s in g})
            full = {k: np.zeros_like(a) for k, a in ref_grads.items()}
            for _, g in everyone:
                for s, gs in g.items():
                    for k, a in gs.items():
                        full[k][s * layers : (s + 1) * layers] = a
            tloss = next(v for v, _ in everyone if v is not None)
            checks[key] = {"loss": tloss, "vs_un_pipelined": max_rel_diff(full, ref_grads),
                           "loss_vs_un_pipelined": abs(tloss - float(ref_loss))}  # fmt: skip
    if rank == 0:
        print("checks " + json.dumps(checks), flush=True)
    for key, c in checks.items():
        assert c["loss_vs_un_pipelined"] <= 1e-4 * max(1.0, abs(c["loss"])), (key, c)
        assert c["vs_un_pipelined"] <= 1e-4, (key, c)
        assert c.get("vs_single_process", 0.0) <= 1e-5, (key, c)

    def progress(r, so_far):
        if rank == 0:
            print(f"round {r + 1}/{args.rounds} done, load {so_far.load[-1]:.1f}", flush=True)

    # warm-up: every program compiled and run once more; then the rounds, each sample
    # between two barriers (so no rank starts the next variant while another runs this one)
    timed = time_rounds(fns, args.rounds, warmup=1, after=dist.barrier, progress=progress)
    keys = list(fns)
    samples = {k: list(zip(timed.wall[k], timed.cpu[k], strict=True)) for k in keys}
    loads = timed.load[1:]
    everyone = [None] * p
    dist.all_gather_object(everyone, (samples, sorted(os.sched_getaffinity(0))))
    affinity = [a for _, a in everyone]
    everyone = [s for s, _ in everyone]
    if rank == 0:
        rows = {}
        for key in keys:
            per_rank = [s[key] for s in everyone]
            wall = [max(w for w, _ in rnd) for rnd in zip(*per_rank, strict=True)]
            cpu = [[c for _, c in rnd] for rnd in zip(*per_rank, strict=True)]
            rows[key] = {"wall_s": wall, "cpu_s_per_rank": cpu,
                         "median_ms": 1e3 * statistics.median(wall)}  # fmt: skip
        result = {"p": p, "affinity_per_rank": affinity, "load_1min": loads,
                  **timed.loads(), "checks": checks, "times": rows}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(result, f)
    leave_both_worlds()


if __name__ == "__main__":
    main()
