"""One worker of ``bench/throughput.py`` (started by ``jaxpg.run``; not run by hand).

In the same processes, torch DDP (gloo) and jaxpg DDP train the 25M-parameter MLP of
``bench/_models.py``, one step of each variant per round, in a rotating order:

* ``torch``: ``torch.nn.parallel.DistributedDataParallel`` (``bucket_cap_mb=25``, SGD
  momentum 0.9), ``torch.set_num_threads(OMP_NUM_THREADS)``;
* ``torch_no_comm``: the same step under ``no_sync()`` (no gradient all-reduce: torch's
  compute, bucket copies and optimizer alone);
* ``torch_allreduce_100MB``: ``dist.all_reduce`` of a 25M-float tensor alone;
* ``jaxpg``: ``jaxpg.ddp.DistributedDataParallel`` with its defaults (1 MB first bucket,
  25 MB buckets, the default averaging hook, donated state);
* ``jaxpg_flat_buckets``: the default buckets through a copy of the default hook, so each
  bucket is copied into a flat buffer and back (the path of every custom hook, and of the
  default hook's earlier path on CPU);
* ``jaxpg_default_copies``: the default step compiled with XLA:CPU's default copy
  insertion (jaxpg's earlier step; it now uses the region analysis);
* ``jaxpg_one_bucket`` / ``jaxpg_cap_5MB``: every gradient in one bucket / 5 MB buckets;
* ``jaxpg_fused_pmean``: ``reduction='fused_pmean'`` (one ``pmean`` per gradient);
* ``jaxpg_rs_ag``: a hook doing ``psum_scatter`` + ``all_gather`` instead of ``psum``;
* ``jaxpg_no_comm``: the ``noop`` hook (flat buckets, no communication);
* ``jax_compute``: the local forward + backward + SGD update alone (``jax.jit``, no
  collective, no buckets; state donated, compiled with the region analysis as DDP's step);
* ``jaxpg_allreduce_100MB``: an eager ``jaxpg.all_reduce`` of the 25M-float gradient size
  alone.

If XLA:CPU ran the bucket all-reduces concurrently with the rest of the backward, the
bucketed step would take less than ``jax_compute + jaxpg_allreduce_100MB``; the overlap
figure is ``(compute + comm - step) / min(compute, comm)`` (0: none, 1: full).
Rank 0 writes the slowest rank's per-round times as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import torch.distributed as dist
from _models import MLP, local_step, loss_fn, make_batch, n_params, torch_mlp  # bench/ is path[0]
from _rounds import medians
from _timing import join_both_worlds, leave_both_worlds, slowest_rank, time_rounds
from flax import nnx

import jaxpg
from jaxpg.ddp import DistributedDataParallel, allreduce_hook
from jaxpg.ddp.train_step import CPU_COMPILER_OPTIONS, build_train_step


class DefaultCopiesDDP(DistributedDataParallel):
    """DDP whose step uses XLA:CPU's default copy insertion (jaxpg's earlier step)."""

    def _step_fn(self, loss_fn, mode):
        key = ("default_copies", loss_fn, mode)
        if key not in self._compiled:
            fn = build_train_step(loss_fn, graphdef=self._graphdef, optimizer=self.optimizer,
                                  plan=self.bucket_plan, comm_hook=self._comm_hook,
                                  pg=self.group, mode=mode, reduction=self.reduction,
                                  donate=False)
            self._compiled[key] = jax.jit(fn, donate_argnums=(0, 1, 2, 3, 4))
        return self._compiled[key]


def rs_ag_hook(state, bucket):
    """The default average as ``psum_scatter`` + ``all_gather`` (padded to N chunks)."""
    n = jax.lax.axis_size(bucket.axis_name)
    buf = bucket.buffer / n
    pad = (-buf.size) % n
    if pad:
        buf = jnp.pad(buf, (0, pad))
    part = jax.lax.psum_scatter(buf, bucket.axis_name, tiled=True)
    out = jax.lax.all_gather(part, bucket.axis_name, tiled=True)
    return out[: bucket.buffer.size], state


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--torch-port", type=int, required=True)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--only", default="", help="comma-separated subset of the variants")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank, n = join_both_worlds(args.torch_port, int(os.environ.get("OMP_NUM_THREADS", "1")))
    batch = make_batch(args.batch, seed=rank)

    # torch DDP
    want = set(args.only.split(",")) if args.only else None
    torch.manual_seed(0)
    tmodel = torch.nn.parallel.DistributedDataParallel(torch_mlp(), bucket_cap_mb=25)
    topt = torch.optim.SGD(tmodel.parameters(), lr=0.01, momentum=0.9)
    tx, ty = torch.from_numpy(batch["x"]), torch.from_numpy(batch["y"]).long()

    def torch_step():
        topt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(tmodel(tx), ty).backward()
        topt.step()

    def torch_no_comm():
        with tmodel.no_sync():
            torch_step()

    tg = torch.ones(n_params())

    def torch_comm():
        dist.all_reduce(tg)

    # jaxpg DDP variants (built only when timed: each holds its own 200 MB of state)
    world = jaxpg.GroupMember.WORLD
    ddp_kwargs = {
        "jaxpg": {},
        "jaxpg_default_copies": {},
        "jaxpg_flat_buckets": {"comm_hook": lambda st, b: allreduce_hook(st, b)},
        "jaxpg_one_bucket": {"bucket_cap_mb": 1e6, "first_bucket_mb": 1e6},
        "jaxpg_cap_5MB": {"bucket_cap_mb": 5},
        "jaxpg_fused_pmean": {"reduction": "fused_pmean"},
        "jaxpg_rs_ag": {"comm_hook": rs_ag_hook},
        "jaxpg_no_comm": {"comm_hook": "noop"},
    }
    ddps = {k: (DefaultCopiesDDP if k == "jaxpg_default_copies" else DistributedDataParallel)(
                MLP(nnx.Rngs(0)), optax.sgd(0.01, momentum=0.9), group=world, **kw)
            for k, kw in ddp_kwargs.items() if want is None or k in want}

    def ddp_step(d):
        d.train_step(loss_fn, batch)
        jax.block_until_ready(d.params)

    # the local compute alone: forward, backward, SGD momentum update (donated)
    model = MLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    opt = optax.sgd(0.01, momentum=0.9)
    state = {"p": params, "o": opt.init(params)}
    jb = jax.device_put(batch)

    local = jax.jit(local_step(graphdef, opt), donate_argnums=(0, 1),
                    compiler_options=CPU_COMPILER_OPTIONS)

    def compute_step():
        state["p"], state["o"] = local(state["p"], state["o"], jb)
        jax.block_until_ready(state["p"])

    g = jnp.ones((n_params(),), jnp.float32)

    def comm_step():
        jax.block_until_ready(jaxpg.all_reduce(g))

    fns = {"torch": torch_step, "torch_no_comm": torch_no_comm,
           "torch_allreduce_100MB": torch_comm}
    fns.update({k: functools.partial(ddp_step, d) for k, d in ddps.items()})
    fns.update({"jax_compute": compute_step, "jaxpg_allreduce_100MB": comm_step})
    if want is not None:
        fns = {k: fns[k] for k in fns if k in want}
    timed = time_rounds(fns, args.steps, warmup=args.warmup)
    per_round = slowest_rank(timed)
    if rank == 0:
        med = medians(per_round)
        ms = {v: 1e3 * t for v, t in med.items()}
        steps = [v for v in ms if v in ("torch", "torch_no_comm", "jax_compute")
                 or (v.startswith("jaxpg") and not v.endswith("_100MB"))]
        out = {
            "n": n, "batch": args.batch, "steps": args.steps, "params": n_params(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "affinity": sorted(os.sched_getaffinity(0)),
            "xla_threads": len(os.listdir("/proc/self/task")),
            "step_ms": ms,
            "round_ms": {v: [1e3 * t for t in x] for v, x in per_round.items()},
            "samples_per_s": {v: n * args.batch / med[v] for v in steps}, **timed.loads(),
        }
        if "torch" in ms:
            out["over_torch_samples"] = {v: ms["torch"] / ms[v] for v in steps}
            if "jaxpg" in ms:
                out["jaxpg_over_torch_samples"] = ms["torch"] / ms["jaxpg"]
        if "jax_compute" in ms and "jaxpg_allreduce_100MB" in ms:
            comp, comm = ms["jax_compute"], ms["jaxpg_allreduce_100MB"]
            out["compute_plus_comm_ms"] = comp + comm
            for v in ("jaxpg", "jaxpg_one_bucket"):
                if v in ms:
                    out[f"overlap_{v}"] = (comp + comm - ms[v]) / min(comp, comm)
        if {"torch", "torch_no_comm", "jaxpg", "jax_compute"} <= set(ms):
            # step = local part + what the gradient all-reduce adds to it
            out["attribution_ms"] = {
                "torch_local": ms["torch_no_comm"],
                "torch_comm_exposed": ms["torch"] - ms["torch_no_comm"],
                "jaxpg_local": ms["jax_compute"],
                "jaxpg_comm_exposed": ms["jaxpg"] - ms["jax_compute"],
            }
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    leave_both_worlds()
    os._exit(0)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
