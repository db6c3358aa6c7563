"""One worker of ``bench/cluster.py`` (started by ``mpirun``; not run by hand).

Joins jaxpg's world from mpirun's variables alone (``init_process_group(backend=B)``, B
``mpi`` or ``gloo``) and a torch gloo world of the same ranks, then times in the same
processes, round by round in a rotating order (``bench/_timing.py``):

* ``jaxpg``: eager ``jaxpg.all_reduce(x)`` of this rank's ``jax.Array``, per size;
* ``xla``: the jitted ``shard_map`` psum over a global array (XLA's collective alone);
* ``torch``: torch gloo's in-place ``dist.all_reduce(t)``;
* ``jaxpg_ddp`` / ``torch_ddp``: a DDP training step of the 25M-parameter MLP
  (``bench/_models.py``), SGD with momentum 0.9, 25 MB buckets, batch 32 per rank.

With ``--dispatch-probe on|off`` it instead times, in one process, JAX's CPU dispatch with
asynchronous dispatch on or off (what backend="mpi" turns off): a chain of small jitted
additions, and the MLP's local training step. Rank 0 (or the probe) writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def _probe(mode: str, out: str) -> None:
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", mode == "on")
    import jax.numpy as jnp
    import optax
    from _models import MLP, local_step, make_batch
    from flax import nnx

    add = jax.jit(lambda x: x + 1.0)
    x = jnp.zeros(16)
    add(x).block_until_ready()
    chain = []
    for _ in range(7):
        t0 = time.perf_counter()
        y = x
        for _ in range(500):
            y = add(y)
        y.block_until_ready()
        chain.append((time.perf_counter() - t0) / 500)
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)))
    tx = optax.sgd(0.01, momentum=0.9)
    step = jax.jit(local_step(graphdef, tx), donate_argnums=(0, 1))
    state = (params, tx.init(params))
    batch = make_batch(32)
    steps = []
    for i in range(6):
        t0 = time.perf_counter()
        state = step(*state, batch)
        jax.block_until_ready(state)
        if i:
            steps.append(time.perf_counter() - t0)
    with open(out, "w") as f:
        json.dump({"async_dispatch": mode, "small_op_us": statistics.median(chain) * 1e6,
                   "mlp_local_step_ms": statistics.median(steps) * 1e3}, f)


def _main(args: argparse.Namespace) -> None:
    import jax
    import optax
    import torch
    import torch.distributed as dist
    from _models import MLP, loss_fn, make_batch, torch_mlp
    from _timing import leave_both_worlds, slowest_rank, time_rounds
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxpg
    from jaxpg.ddp import DistributedDataParallel

    jaxpg.init_process_group(backend=args.backend)
    rank, n = jaxpg.get_rank(), jaxpg.get_world_size()
    import os

    torch.set_num_threads(len(os.sched_getaffinity(0)))  # the CPUs XLA's pool also sizes to
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.torch_port}",
                            rank=rank, world_size=n)
    mesh = Mesh(np.array(jax.devices()), ("i",))
    psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "i"), mesh=mesh, in_specs=P("i"),
                                 out_specs=P("i")))
    result: dict = {"backend": jaxpg.get_backend(), "world_size": n, "sizes": {}}
    for mb in args.sizes_mb:
        elems = int(mb * 2**20) // 4
        host = np.full(elems, rank + 1, np.float32)
        local = jax.device_put(host, jax.local_devices()[0])
        glob = jax.make_array_from_process_local_data(NamedSharding(mesh, P("i")), host,
                                                      (n * elems,))
        tensor = torch.from_numpy(host.copy())
        got = np.asarray(jaxpg.all_reduce(local))
        assert np.allclose(got[:4], n * (n + 1) / 2), got[:4]  # the right sum, once
        fns = {"jaxpg": lambda local=local: jaxpg.all_reduce(local),
               "xla": lambda glob=glob: psum(glob),
               "torch": lambda tensor=tensor: dist.all_reduce(tensor)}
        for f in fns.values():  # compile and warm up
            f()
        times = slowest_rank(time_rounds(fns, args.rounds, args.iters))
        result["sizes"][str(mb)] = times
    # DDP: the same model and optimizer in both frameworks
    batch = make_batch(32 * n, seed=1)
    mine = {k: v[32 * rank: 32 * rank + 32] for k, v in batch.items()}
    ddp = DistributedDataParallel(MLP(nnx.Rngs(0)), optax.sgd(0.01, momentum=0.9),
                                  bucket_cap_mb=25)
    model = torch.nn.parallel.DistributedDataParallel(torch_mlp(), bucket_cap_mb=25)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    tx, ty = torch.from_numpy(mine["x"]), torch.from_numpy(mine["y"]).long()

    def torch_step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(tx), ty).backward()
        opt.step()

    steps = {"jaxpg_ddp": lambda: ddp.train_step(loss_fn, mine)["loss"], "torch_ddp": torch_step}
    for f in steps.values():
        f()
    result["ddp"] = slowest_rank(time_rounds(steps, args.ddp_rounds))
    leave_both_worlds()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="mpi")
    p.add_argument("--torch-port", type=int, default=0)
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--ddp-rounds", type=int, default=5)
    p.add_argument("--dispatch-probe", choices=("on", "off"), default=None)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.dispatch_probe:
        _probe(a.dispatch_probe, a.out)
    else:
        _main(a)
