"""A fresh loss closure each step against one loss function reused: DDP, FSDP, the pipeline.

torch users write ``ddp.train_step(lambda m, b: loss(m(b[0]), b[1]), batch)`` in a loop.
The compiled steps are cached by the function's code and closure
(``jaxpg.data_parallel.step_cache``), so both forms should run at the same speed. One
process, 2 simulated CPU devices, a 2-layer MLP; the two forms alternate round by round
(``bench/_rounds.py``), ``--steps`` steps of each per round; the median over rounds counts.

    python bench/step_cache.py      # writes bench/results/step_cache.json
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the shared helpers

import argparse  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _launch import RESULTS  # noqa: E402
from _rounds import run_rounds  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jaxpg  # noqa: E402
from jaxpg.ddp import DistributedDataParallel  # noqa: E402
from jaxpg.fsdp import FullyShardedDataParallel  # noqa: E402
from jaxpg.pipeline.api import StagedParams, pipeline_value_and_grad  # noqa: E402


class MLP(nnx.Module):
    def __init__(self, seed: int):
        rngs = nnx.Rngs(seed)
        self.l1, self.l2 = nnx.Linear(32, 64, rngs=rngs), nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def mse(model, batch):
    return jnp.mean((model(batch[0]) - batch[1]) ** 2)


def _wrapper_variants(wrapper_cls):
    rng = np.random.default_rng(0)
    batch = (rng.standard_normal((16, 32)).astype(np.float32),
             rng.standard_normal((16, 8)).astype(np.float32))
    wrapper = wrapper_cls(MLP(0), optax.sgd(0.01), group=jaxpg.GroupMember.WORLD)
    return {
        "reused loss_fn": lambda: wrapper.train_step(mse, batch)["loss"],
        "fresh lambda": lambda: wrapper.train_step(lambda m, b: mse(m, b), batch)["loss"],
    }


def _pipeline_variants():
    k = jax.random.split(jax.random.key(0), 3)
    params = StagedParams({"w": jax.random.normal(k[0], (2, 32, 32)) * 0.2}, None,
                          jax.random.normal(k[1], (32, 8)))
    x, t = jax.random.normal(k[2], (16, 32)), jnp.ones((16, 8))
    mesh = Mesh(np.array(jax.devices()[:2]), ("pp",))

    def block(w, h):
        return jnp.tanh(h @ w["w"])

    def head(last, h, tt):
        return jnp.mean((h @ last - tt) ** 2)

    def call(stage_fn, loss_fn):
        return pipeline_value_and_grad(stage_fn, loss_fn, params, x, t, mesh=mesh,
                                       schedule="1f1b", num_microbatches=4, executor="spmd")

    return {
        "reused loss_fn": lambda: call(block, head),
        "fresh lambda": lambda: call(lambda w, h: block(w, h), lambda a, h, tt: head(a, h, tt)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="steps of each form per round")
    p.add_argument("--out", default=str(RESULTS / "step_cache.json"))
    args = p.parse_args()
    jaxpg.init_process_group()
    results = {"devices": jax.device_count(), "rounds": args.rounds,
               "steps_per_round": args.steps, "jax": jax.__version__, "ms_per_step": {}}
    for name, variants in (("DistributedDataParallel.train_step",
                            _wrapper_variants(DistributedDataParallel)),
                           ("FullyShardedDataParallel.train_step",
                            _wrapper_variants(FullyShardedDataParallel)),
                           ("pipeline_value_and_grad", _pipeline_variants())):
        # compiled once by the warm-up call, outside the timing
        timed = run_rounds(variants, args.rounds, iters=args.steps, warmup=1)
        ms = {key: round(1e3 * v, 3) for key, v in timed.medians().items()}
        ms["ratio fresh/reused"] = round(ms["fresh lambda"] / ms["reused loss_fn"], 3)
        results["ms_per_step"][name] = ms
        results.setdefault("load_average_before", timed.load_before)
        results["load_average_after"] = timed.load_after
        print(name, ms, flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    jaxpg.destroy_process_group()


# python -m bench step_cache --quick: a short run, written under /tmp unless --out is given
QUICK_ARGS = ["--rounds", "1", "--steps", "2"]

if __name__ == "__main__":
    main()
