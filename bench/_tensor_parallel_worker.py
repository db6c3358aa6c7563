"""One rank of ``bench/tensor_parallel.py``: jaxpg's tensor parallelism beside torch's
``parallelize_module``, in the same processes (gloo, one CPU process per rank).

Models (the same weights in both, copied from the flax modules; the same data on every
rank): ``mlp`` (``d -> 4d -> d``, up ColwiseParallel, down RowwiseParallel), ``block`` (a
pre-LN transformer block with a fused, head-major QKV: qkv and up Colwise, proj and down
Rowwise) and ``block_sp`` (the block with sequence parallelism). A step is forward,
backward (parameters and the input, as a block inside a deeper model) and an SGD update.
Steps alternate between torch and jaxpg round by round (``_timing.time_rounds``); the
slowest rank's time of each round counts.

Also recorded per model: the loss of both at the first step (the same weights and data
must give the same value), the collectives of jaxpg's compiled step (instructions and
bytes), and the parameter bytes each rank holds in each library against the full model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _rounds import medians, ratio_median
from _timing import join_both_worlds, leave_both_worlds, slowest_rank, time_rounds
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor.parallel import ColwiseParallel as TColwise
from torch.distributed.tensor.parallel import RowwiseParallel as TRowwise
from torch.distributed.tensor.parallel import SequenceParallel as TSequenceParallel
from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

import jaxpg
from jaxpg import tensor_parallel as tp
from jaxpg.ddp.train_step import CPU_COMPILER_OPTIONS
from jaxpg.internal import collective_bytes, collective_counts
from jaxpg.tensor_parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, Shard

EPS = 1e-6
LR = 1e-3


class Mlp(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.hd = d // heads
        self.ln1 = nnx.LayerNorm(d, epsilon=EPS, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.proj = nnx.Linear(d, d, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, epsilon=EPS, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        h = self.qkv(self.ln1(x))
        b, t = h.shape[:2]
        h = h.reshape(b, t, -1, 3, self.hd)
        s = jnp.einsum("bqhd,bkhd->bhqk", h[..., 0, :], h[..., 1, :]) / math.sqrt(self.hd)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), h[..., 2, :])
        x = x + self.proj(a.reshape(b, t, -1))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class TorchMlp(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class TorchBlock(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.hd = d // heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d, eps=EPS), torch.nn.LayerNorm(d, eps=EPS)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.qkv(self.ln1(x))
        b, t = h.shape[:2]
        h = h.view(b, t, -1, 3, self.hd)
        s = torch.einsum("bqhd,bkhd->bhqk", h[..., 0, :], h[..., 1, :]) / math.sqrt(self.hd)
        s = s.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool)), -1e9)
        a = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), h[..., 2, :])
        x = x + self.proj(a.reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


def plans(sp: bool) -> tuple[dict, dict]:
    """(jaxpg's plan, torch's plan) for the block; the MLP uses the block's up/down."""
    if not sp:
        return ({"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                 "up": ColwiseParallel(), "down": RowwiseParallel()},
                {"qkv": TColwise(), "proj": TRowwise(), "up": TColwise(), "down": TRowwise()})
    return ({"ln1": SequenceParallel(), "qkv": ColwiseParallel(input_layouts=Shard(1)),
             "proj": RowwiseParallel(output_layouts=Shard(1)), "ln2": SequenceParallel(),
             "up": ColwiseParallel(input_layouts=Shard(1)),
             "down": RowwiseParallel(output_layouts=Shard(1))},
            {"ln1": TSequenceParallel(), "qkv": TColwise(input_layouts=TorchShard(1)),
             "proj": TRowwise(output_layouts=TorchShard(1)), "ln2": TSequenceParallel(),
             "up": TColwise(input_layouts=TorchShard(1)),
             "down": TRowwise(output_layouts=TorchShard(1))})


def copy_weights(jmodel: nnx.Module, tmodel: torch.nn.Module) -> None:
    """torch's Linear holds the kernel transposed; LayerNorm's scale is its weight."""
    with torch.no_grad():
        for name, module in tmodel.named_children():
            jm = getattr(jmodel, name)
            w = jm.kernel[...] if isinstance(jm, nnx.Linear) else jm.scale[...]
            w = np.asarray(w).T if isinstance(jm, nnx.Linear) else np.asarray(w)
            module.weight.copy_(torch.from_numpy(w.copy()))
            module.bias.copy_(torch.from_numpy(np.asarray(jm.bias[...]).copy()))


def jax_step(model: nnx.Module, mesh, x_spec: P, compiler_options=None):
    """jit(shard_map): loss (a per-rank sum, summed over tp for SP), gradients of the
    parameters and the input, and the SGD update; donates the parameters."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    specs, rest_specs = tp.param_specs(params), tp.param_specs(rest)
    total = None

    def body(params, rest, x):
        def loss(p, x):
            return jnp.sum(nnx.merge(graphdef, p, rest)(x) ** 2) / total

        value, (g, gx) = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
        params = jax.tree.map(lambda p, g: p - LR * g, params, g)
        return params, value[None], gx  # this rank's loss (a partial sum under SP)

    def make(x):
        nonlocal total
        total = float(np.prod(x.shape))
        fn = jax.shard_map(body, mesh=mesh.jax_mesh, in_specs=(specs, rest_specs, x_spec),
                           out_specs=(specs, P("tp"), x_spec), check_vma=False)
        # as DDP's step: donated parameters, updated in place (docs/design.md)
        return jax.jit(fn, donate_argnums=(0,), compiler_options=compiler_options)

    return make, params, rest


def param_bytes_jax(params) -> int:
    device = jax.local_devices()[0]
    return sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards
               if s.device == device)


def param_bytes_torch(model: torch.nn.Module) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def ddp_step(name: str, args, n: int, x: np.ndarray, x_sharding) -> Any:
    """The composed step: ``parallelize_module`` and ``DistributedDataParallel`` over the
    one-rank ``dp`` dimension of a ``(1, n)`` ``("dp", "tp")`` mesh, the same weights, loss
    and SGD update as :func:`jax_step` (but no input gradient: DDP's step has none)."""
    from jaxpg.ddp import DistributedDataParallel

    model = Mlp(args.dim, nnx.Rngs(0)) if name == "mlp" else Block(args.dim, args.heads,
                                                                    nnx.Rngs(0))
    jplan, _ = plans(False)
    if name == "mlp":
        jplan = {k: v for k, v in jplan.items() if k in ("up", "down")}
    mesh = jaxpg.init_device_mesh((1, n), ("dp", "tp"))
    tp.parallelize_module(model, mesh["tp"], jplan, src_data_rank=None)
    ddp = DistributedDataParallel(model, optax.sgd(LR), group=mesh.get_group("dp"))
    total = float(np.prod(x.shape))

    def loss_fn(m, batch):
        return jnp.sum(m(batch) ** 2) / total

    return lambda: jax.block_until_ready(ddp.train_step(loss_fn, x)["loss"])


def run_model(name: str, args, rank: int, n: int) -> dict:
    sp = name == "block_sp"
    d = args.dim
    jmodel = Mlp(d, nnx.Rngs(0)) if name == "mlp" else Block(d, args.heads, nnx.Rngs(0))
    tmodel = TorchMlp(d) if name == "mlp" else TorchBlock(d, args.heads)
    copy_weights(jmodel, tmodel)
    full_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(jmodel, nnx.Param)))
    jplan, tplan = plans(sp)
    if name == "mlp":
        jplan = {k: v for k, v in jplan.items() if k in ("up", "down")}
        tplan = {k: v for k, v in tplan.items() if k in ("up", "down")}
    mesh = jaxpg.init_device_mesh((n,), ("tp",))
    tp.parallelize_module(jmodel, mesh, jplan, src_data_rank=None)
    torch_parallelize(tmodel, init_device_mesh("cpu", (n,)), tplan)
    topt = torch.optim.SGD(tmodel.parameters(), lr=LR)

    x = np.random.default_rng(1).normal(size=(args.batch, args.seq, d)).astype(np.float32)
    chunk = args.seq // n
    x_local = x[:, rank * chunk:(rank + 1) * chunk] if sp else x
    x_spec = P(None, "tp") if sp else P()
    make, params, rest = jax_step(jmodel, mesh, x_spec, CPU_COMPILER_OPTIONS)
    jx = jax.device_put(x, NamedSharding(mesh.jax_mesh, x_spec))
    step = make(x)
    compiled = step.lower(params, rest, jx).compile()
    state = {"params": params}
    first: dict[str, float] = {}

    def jaxpg_step():
        state["params"], loss, gx = step(state["params"], rest, jx)
        jax.block_until_ready(state["params"])
        return loss

    tx = torch.from_numpy(x_local.copy()).requires_grad_(True)

    def torch_step():
        topt.zero_grad(set_to_none=True)
        tx.grad = None
        loss = torch.sum(tmodel(tx) ** 2) / x.size
        loss.backward()
        topt.step()
        return loss

    # The first step of each: the same weights and data give the same loss.
    jl = torch.tensor(float(np.asarray(jaxpg_step().addressable_data(0))[0]))
    tl = torch_step().detach().clone()
    if sp:  # per-rank partial sums over the sequence chunks
        dist.all_reduce(jl)
        dist.all_reduce(tl)
    first["jaxpg"], first["torch"] = float(jl), float(tl)
    fns = {"torch": torch_step, "jaxpg": jaxpg_step}
    if args.variants:  # the same step compiled with XLA's default copy insertion
        make2, params2, _ = jax_step(jmodel, mesh, x_spec)
        step2 = make2(x)
        state2 = {"params": jax.tree.map(lambda a: a.copy(), state["params"])}

        def jaxpg_default_copies():
            state2["params"], loss, _ = step2(state2["params"], rest, jx)
            jax.block_until_ready(state2["params"])
            return loss

        fns["jaxpg_default_copies"] = jaxpg_default_copies
        # the unit of tensor-parallel communication: one all-reduce of an activation
        act = torch.ones(x.shape)
        jact = jax.device_put(np.ones((n, *x.shape), np.float32),
                              NamedSharding(mesh.jax_mesh, P("tp")))
        psum = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "tp"), mesh=mesh.jax_mesh,
                                     in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
        fns["torch_allreduce_activation"] = lambda: dist.all_reduce(act)
        fns["jaxpg_allreduce_activation"] = lambda: jax.block_until_ready(psum(jact))
    if args.compose and not sp:  # the same model through DDP on a (dp=1, tp=n) mesh
        fns["jaxpg_ddp"] = ddp_step(name, args, n, x, jx.sharding)
    timed = time_rounds(fns, args.rounds, warmup=args.warmup)
    per_round = slowest_rank(timed)
    med = medians(per_round)
    return {
        "step_ms": {v: 1e3 * t for v, t in med.items()},
        "round_ms": {v: [1e3 * t for t in ts] for v, ts in per_round.items()},
        "jaxpg_over_torch_speed": med["torch"] / med["jaxpg"],
        "jaxpg_over_torch_speed_per_round_median": ratio_median(per_round["torch"],
                                                               per_round["jaxpg"]),
        **timed.loads(),
        "first_loss": first,
        "collectives": collective_counts(compiled),
        "collective_bytes": collective_bytes(compiled),
        "param_bytes_per_rank": {"jaxpg": param_bytes_jax(state["params"]),
                                 "torch": param_bytes_torch(tmodel), "full": full_bytes},
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--torch-port", type=int, required=True)
    p.add_argument("--models", default="mlp,block,block_sp")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--variants", action="store_true",
                   help="also time jaxpg's step without the CPU copy-insertion option")
    p.add_argument("--compose", action="store_true",
                   help="also time the model through DistributedDataParallel on (dp=1, tp)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank, n = join_both_worlds(args.torch_port, int(os.environ.get("OMP_NUM_THREADS", "1")))
    results = {m: run_model(m, args, rank, n) for m in args.models.split(",")}
    if rank == 0:
        out = {"tp": n, "dim": args.dim, "heads": args.heads, "batch": args.batch,
               "seq": args.seq, "rounds": args.rounds, "models": results}
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    leave_both_worlds()
    os._exit(0)


if __name__ == "__main__":
    main()
