"""One worker of ``bench/fsdp.py`` (started by ``jaxpg.run``; not run by hand).

In the same processes (one rank each, gloo), with the same weights and data, one Adam
step of each variant per round, in a rotating order:

* ``torch_fsdp2``: torch's ``fully_shard`` on every block and on the root;
* ``jaxpg_ddp``: ``jaxpg.ddp.DistributedDataParallel``;
* ``jaxpg_zero1``: the same with ``zero_stage=1``;
* ``jaxpg_stage1`` / ``jaxpg_stage2`` / ``jaxpg_stage3``: ``FullyShardedDataParallel``
  (stage 3 with every block a unit, ``reshard_after_forward=True``);
* ``jaxpg_stage3_keep``: stage 3 with ``reshard_after_forward=False``.

Per rank it also records the bytes of parameters + gradients + optimizer state each
variant holds (torch: the local tensors of the sharded parameters, their gradients and
Adam's moments; jaxpg: :func:`jaxpg.fsdp.memory.step_memory`, which adds XLA's peak of the
compiled step). Rank 0 writes the slowest rank's per-round times and rank 0's bytes to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import numpy as np
import optax
import torch
from _rounds import medians
from _timing import join_both_worlds, leave_both_worlds, slowest_rank, time_rounds
from flax import nnx
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from jaxpg.ddp import DistributedDataParallel
from jaxpg.fsdp import FullyShardedDataParallel
from jaxpg.fsdp.memory import step_memory

D_IN, D, FFN, OUT = 512, 512, 2048, 10


class Block(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(D, FFN, rngs=rngs)
        self.down = nnx.Linear(FFN, D, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.relu(self.up(x)))


class ResMLP(nnx.Module):
    def __init__(self, depth, seed=0):
        rngs = nnx.Rngs(seed)
        self.inp = nnx.Linear(D_IN, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(depth)])
        self.out = nnx.Linear(D, OUT, rngs=rngs)

    def __call__(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def loss_fn(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


class TorchBlock(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.up, self.down = _linear(block.up), _linear(block.down)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _linear(layer):
    kernel = np.asarray(layer.kernel[...])
    lin = torch.nn.Linear(*kernel.shape)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(kernel.T.copy()))
        lin.bias.copy_(torch.from_numpy(np.array(layer.bias[...])))
    return lin


def torch_model(model):
    """The same weights in torch (kernels transposed into ``Linear.weight``)."""
    return torch.nn.Sequential(_linear(model.inp), *[TorchBlock(b) for b in model.blocks],
                               _linear(model.out))


def torch_state_bytes(tmodel, topt):
    """This rank's bytes of sharded parameters, gradients and Adam moments."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    total = 0
    for p in tmodel.parameters():
        total += local(p).numel() * 4
        if p.grad is not None:
            total += local(p.grad).numel() * 4
    for state in topt.state.values():
        for k in ("exp_avg", "exp_avg_sq"):
            total += local(state[k]).numel() * 4
    return total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--torch-port", type=int, required=True)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=16, help="samples per rank")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--only", default="")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank, n = join_both_worlds(args.torch_port, int(os.environ.get("OMP_NUM_THREADS", "1")))
    rng = np.random.default_rng(rank)
    batch = {"x": rng.standard_normal((args.batch, D_IN)).astype(np.float32),
             "y": rng.integers(0, OUT, args.batch).astype(np.int32)}
    want = set(args.only.split(",")) if args.only else None
    lr = 1e-3

    model = ResMLP(args.depth)
    tmodel = torch_model(model)
    mesh = init_device_mesh("cpu", (n,))
    for block in tmodel[1:-1]:
        fully_shard(block, mesh=mesh)
    fully_shard(tmodel, mesh=mesh)
    topt = torch.optim.Adam(tmodel.parameters(), lr=lr)
    tx, ty = torch.from_numpy(batch["x"]), torch.from_numpy(batch["y"]).long()

    def torch_step():
        topt.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(tmodel(tx), ty).backward()
        topt.step()

    kinds = {
        "jaxpg_ddp": lambda: DistributedDataParallel(ResMLP(args.depth), optax.adam(lr)),
        "jaxpg_zero1": lambda: DistributedDataParallel(ResMLP(args.depth), optax.adam(lr),
                                                       zero_stage=1),
        "jaxpg_stage1": lambda: FullyShardedDataParallel(ResMLP(args.depth), optax.adam(lr),
                                                         zero_stage=1),
        "jaxpg_stage2": lambda: FullyShardedDataParallel(ResMLP(args.depth), optax.adam(lr),
                                                         zero_stage=2),
        "jaxpg_stage3": lambda: FullyShardedDataParallel(ResMLP(args.depth), optax.adam(lr),
                                                         units=Block),
        "jaxpg_stage3_keep": lambda: FullyShardedDataParallel(
            ResMLP(args.depth), optax.adam(lr), units=Block, reshard_after_forward=False),
    }
    wrappers = {k: make() for k, make in kinds.items() if want is None or k in want}

    def jaxpg_step(w):
        w.train_step(loss_fn, batch)
        jax.block_until_ready(w.params)

    fns = {"torch_fsdp2": torch_step} if want is None or "torch_fsdp2" in want else {}
    fns.update({k: (lambda w=w: jaxpg_step(w)) for k, w in wrappers.items()})
    timed = time_rounds(fns, args.rounds, warmup=args.warmup)
    per_round = slowest_rank(timed)
    memory = {k: step_memory(w, loss_fn, batch).as_dict() for k, w in wrappers.items()}
    if "torch_fsdp2" in fns:
        memory["torch_fsdp2"] = {"state": torch_state_bytes(tmodel, topt)}
    # every variant trained the same steps from the same weights: compare them with
    # jaxpg's DDP (same numerics: should agree to float32 rounding) and torch's with it
    # (different kernels: Adam's first steps, m / sqrt(v) ~ sign(g), turn rounding-level
    # differences of near-zero gradients into differences of up to lr per step)
    def first_layer(w):
        full = w.full_params() if hasattr(w, "full_params") else w.params
        return [np.asarray(full["inp"]["kernel"]), np.asarray(full["inp"]["bias"])]

    agree = {}
    if "jaxpg_ddp" in wrappers:
        ref = first_layer(wrappers["jaxpg_ddp"])
        scale = max(float(np.abs(r).max()) for r in ref)
        diff = lambda mine: max(float(np.abs(a - b).max()) for a, b in zip(mine, ref)) / scale
        agree = {k: diff(first_layer(w)) for k, w in wrappers.items() if k != "jaxpg_ddp"}
        if "torch_fsdp2" in fns:
            weight, bias = (t.full_tensor().detach().numpy() for t in list(tmodel.parameters())[:2])
            agree["torch_fsdp2"] = diff([weight.T, bias])
    if rank == 0:
        med = {v: t * 1e3 for v, t in medians(per_round).items()}
        out = {
            "n": n, "depth": args.depth, "batch_per_rank": args.batch, "rounds": args.rounds,
            "params": sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))),
            "step_ms": med, "round_ms": {v: [1e3 * t for t in x] for v, x in per_round.items()},
            "memory_bytes": memory, "first_layer_rel_diff_vs_jaxpg_ddp": agree,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), **timed.loads(),
        }
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    leave_both_worlds()
    os._exit(0)


if __name__ == "__main__":
    main()
