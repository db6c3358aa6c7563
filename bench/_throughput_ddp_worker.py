"""One worker of ``bench/throughput.py`` (started by ``jaxpg.run``; not run by hand).

In the same processes, torch DDP (gloo) and jaxpg DDP train the 25M-parameter MLP of
``bench/ddp.py``, one step of each variant per round, in a rotating order:

* ``torch``: ``torch.nn.parallel.DistributedDataParallel`` (``bucket_cap_mb=25``, SGD
  momentum 0.9), ``torch.set_num_threads(OMP_NUM_THREADS)``;
* ``jaxpg``: ``jaxpg.ddp.DistributedDataParallel`` with its defaults (25 MB buckets,
  donated state);
* ``jaxpg_one_bucket``: every gradient in one bucket (one all-reduce after the backward);
* ``jaxpg_fused_pmean``: ``reduction='fused_pmean'`` (one ``pmean`` per gradient, no
  flattening into buckets);
* ``jax_compute``: the local forward + backward + SGD update alone (``jax.jit``, no
  collective);
* ``jaxpg_allreduce_100MB``: an eager ``jaxpg.all_reduce`` of the 25M-float gradient size
  alone.

If XLA:CPU ran the bucket all-reduces concurrently with the rest of the backward, the
bucketed step would take less than ``jax_compute + jaxpg_allreduce_100MB``; the overlap
figure is ``(compute + comm - step) / min(compute, comm)`` (0: none, 1: full).
Rank 0 writes the slowest rank's per-round times as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import torch.distributed as dist
from ddp import LAYERS, MLP, loss_fn, make_batch, n_params  # bench/ is sys.path[0]
from flax import nnx

import jaxpg
from jaxpg.ddp import DistributedDataParallel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--torch-port", type=int, required=True)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--only", default="", help="comma-separated subset of the variants")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    jaxpg.init_process_group()
    rank, n = jaxpg.get_rank(), jaxpg.get_world_size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.torch_port}",
                            rank=rank, world_size=n)
    batch = make_batch(args.batch, seed=rank)

    # torch DDP
    torch.manual_seed(0)
    mods = []
    for a, b in zip(LAYERS[:-1], LAYERS[1:], strict=True):
        mods += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    tmodel = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*mods[:-1]),
                                                       bucket_cap_mb=25)
    topt = torch.optim.SGD(tmodel.parameters(), lr=0.01, momentum=0.9)
    tx, ty = torch.from_numpy(batch["x"]), torch.from_numpy(batch["y"]).long()

    def torch_step():
        topt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(tmodel(tx), ty).backward()
        topt.step()

    # jaxpg DDP, bucketed and one bucket
    world = jaxpg.GroupMember.WORLD
    ddp = DistributedDataParallel(MLP(nnx.Rngs(0)), optax.sgd(0.01, momentum=0.9), group=world)
    one = DistributedDataParallel(MLP(nnx.Rngs(0)), optax.sgd(0.01, momentum=0.9), group=world,
                                  bucket_cap_mb=1e6, first_bucket_mb=1e6)
    fused = DistributedDataParallel(MLP(nnx.Rngs(0)), optax.sgd(0.01, momentum=0.9),
                                    group=world, reduction="fused_pmean")

    def ddp_step(d):
        d.train_step(loss_fn, batch)
        jax.block_until_ready(d.params)

    # the local compute alone: forward, backward, SGD momentum update (donated)
    model = MLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    opt = optax.sgd(0.01, momentum=0.9)
    state = {"p": params, "o": opt.init(params)}
    jb = jax.device_put(batch)

    def local(p, o, b):
        def lf(p):
            return loss_fn(nnx.merge(graphdef, p), b)

        g = jax.grad(lf)(p)
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), o

    local = jax.jit(local, donate_argnums=(0, 1))

    def compute_step():
        state["p"], state["o"] = local(state["p"], state["o"], jb)
        jax.block_until_ready(state["p"])

    g = jnp.ones((n_params(),), jnp.float32)

    def comm_step():
        jax.block_until_ready(jaxpg.all_reduce(g))

    fns = {"torch": torch_step, "jaxpg": lambda: ddp_step(ddp),
           "jaxpg_one_bucket": lambda: ddp_step(one),
           "jaxpg_fused_pmean": lambda: ddp_step(fused), "jax_compute": compute_step,
           "jaxpg_allreduce_100MB": comm_step}
    if args.only:
        fns = {k: fns[k] for k in args.only.split(",")}
    for f in fns.values():
        for _ in range(args.warmup):
            dist.barrier()
            f()
    times = {v: [] for v in fns}
    order = list(fns)
    for r in range(args.steps):
        for v in order[r % len(order):] + order[: r % len(order)]:
            dist.barrier()
            t0 = time.perf_counter()
            fns[v]()
            times[v].append(time.perf_counter() - t0)
    allt = [None] * n
    dist.all_gather_object(allt, times)
    if rank == 0:
        per_round = {v: [max(t[v][r] for t in allt) for r in range(args.steps)] for v in fns}
        med = {v: statistics.median(x) for v, x in per_round.items()}
        if len(med) < len(order):
            with open(args.out, "w") as f:
                json.dump({"step_ms": {v: 1e3 * t for v, t in med.items()}}, f)
            os._exit(0)
        comp, comm = med["jax_compute"], med["jaxpg_allreduce_100MB"]
        out = {
            "n": n, "batch": args.batch, "steps": args.steps, "params": n_params(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "affinity": sorted(os.sched_getaffinity(0)),
            "xla_threads": len(os.listdir("/proc/self/task")),
            "step_ms": {v: 1e3 * t for v, t in med.items()},
            "round_ms": {v: [1e3 * t for t in x] for v, x in per_round.items()},
            "samples_per_s": {v: n * args.batch / med[v]
                              for v in ("torch", "jaxpg", "jaxpg_one_bucket",
                                        "jaxpg_fused_pmean")},
            "compute_plus_comm_ms": 1e3 * (med["jax_compute"] + med["jaxpg_allreduce_100MB"]),
            "jaxpg_over_torch_samples": med["torch"] / med["jaxpg"],
            "overlap_bucketed": (comp + comm - med["jaxpg"]) / min(comp, comm),
            "overlap_one_bucket": (comp + comm - med["jaxpg_one_bucket"]) / min(comp, comm),
        }
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    jaxpg.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
