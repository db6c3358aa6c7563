"""Composition at no cost: a tensor-parallel MLP trained through DDP or FSDP on a
``("dp", "tp")`` mesh against the same step written by hand under ``jax.shard_map``.

The model is ``d -> 8d -> d`` (``parallelize_module`` with ``ColwiseParallel`` up and
``RowwiseParallel`` down), SGD, a mean-squared-error loss, on a 1 x 2 mesh of simulated CPU
devices in one process. The hand-written step holds the same weights and issues the one
``psum`` Megatron's convention needs (forward, with an identity backward). The three steps
alternate round by round (``bench/_rounds.py``), ``--steps`` steps of each per round; the
median over rounds counts. Every step, all three
take the batch from host memory (numpy), as a training loop hands it over. The first-step losses
of the three must agree (the same weights and data), and the compiled steps' collectives
are counted.

    python bench/tp_composition.py [--dim 1024] [--rounds 5]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _launch import RESULTS  # noqa: E402  (bench/ is sys.path[0])
from _rounds import run_rounds  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpg  # noqa: E402
from jaxpg.ddp import DistributedDataParallel  # noqa: E402
from jaxpg.fsdp import FullyShardedDataParallel  # noqa: E402
from jaxpg.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

LR, BATCH = 0.01, 32


class Mlp(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.up = nnx.Linear(d, 8 * d, rngs=rngs)
        self.down = nnx.Linear(8 * d, d, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


@jax.custom_vjp
def _reduce_from_tp(x):
    return jax.lax.psum(x, "tp")


_reduce_from_tp.defvjp(lambda x: (jax.lax.psum(x, "tp"), None), lambda _, ct: (ct,))


def hand_written_step(mesh: jax.sharding.Mesh):
    """The step as one would write it: one shard_map, one forward psum, SGD in place."""

    def local(p, x, y):
        def loss(p):
            h = jax.nn.gelu(x @ p["up_k"] + p["up_b"])
            return jnp.mean((_reduce_from_tp(h @ p["down_k"]) + p["down_b"] - y) ** 2)

        value, grads = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, g: a - LR * g, p, grads), value

    specs = {"up_k": P(None, "tp"), "up_b": P("tp"), "down_k": P("tp", None), "down_b": P()}
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, P(), P()),
                                 out_specs=(specs, P()), check_vma=False),
                   donate_argnums=0), specs


def collectives(compiled_text: str) -> dict[str, int]:
    ops = ("all-reduce(", "all-gather(", "reduce-scatter(", "collective-permute(", " copy(")
    return {op.strip(" ("): compiled_text.count(op) for op in ops}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=str(RESULTS / "tp_composition.json"))
    args = parser.parse_args()
    jaxpg.init_process_group()
    mesh = jaxpg.init_device_mesh((1, 2), ("dp", "tp"))
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    rng = np.random.default_rng(0)
    batch = {k: rng.standard_normal((BATCH, args.dim)).astype(np.float32) for k in "xy"}

    ddp = DistributedDataParallel(parallelize_module(Mlp(args.dim, nnx.Rngs(0)), mesh["tp"],
                                                     plan),
                                  optax.sgd(LR), group=mesh.get_group("dp"))
    fsdp = FullyShardedDataParallel(parallelize_module(Mlp(args.dim, nnx.Rngs(0)), mesh["tp"],
                                                       plan),
                                    optax.sgd(LR), group=mesh.get_group("dp"))
    model = Mlp(args.dim, nnx.Rngs(0))
    jmesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    hand, specs = hand_written_step(jmesh)
    weights = {"up_k": model.up.kernel[...], "up_b": model.up.bias[...],
               "down_k": model.down.kernel[...], "down_b": model.down.bias[...]}
    state = {"p": {k: jax.device_put(v, NamedSharding(jmesh, specs[k]))
                   for k, v in weights.items()}}
    hand_text = hand.lower(state["p"], batch["x"], batch["y"]).compile().as_text()

    def hand_step():  # host data each step, as the wrappers get it
        state["p"], value = hand(state["p"], batch["x"], batch["y"])
        return value

    variants = {
        "DDP(parallelize_module)": lambda: ddp.train_step(mse, batch)["loss"],
        "FSDP(parallelize_module)": lambda: fsdp.train_step(mse, batch)["loss"],
        "hand-written shard_map": hand_step,
    }
    first_loss = {k: float(step()) for k, step in variants.items()}  # compiles, then checks
    timed = run_rounds(variants, args.rounds, iters=args.steps)
    med = timed.medians()
    hand = med["hand-written shard_map"]
    result = {
        "dim": args.dim, "batch": BATCH, "mesh": "dp=1 x tp=2, one process, 2 CPU devices",
        "jax": jax.__version__, **timed.loads(),
        "first_step_loss": first_loss,
        "ms_per_step": {k: round(1e3 * v, 3) for k, v in med.items()},
        "ratio_to_hand_written": {k: round(v / hand, 3) for k, v in med.items()},
        "hand_written_collectives": collectives(hand_text),
    }
    print(json.dumps(result, indent=1))
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    jaxpg.destroy_process_group()


# python -m bench tp_composition --quick: a short run, written under /tmp unless --out is given
QUICK_ARGS = ["--rounds", "1", "--steps", "2"]

if __name__ == "__main__":
    main()
