"""What a recorded jitted step costs: DDP's ``train_step`` across 2 processes (gloo), as
jaxpg runs it (a recorded collective call: numbered, in the flight recorder, waited for
with a timeout on the runner thread) against the same compiled step called directly.

In the same processes, rounds alternate three variants of ``steps`` steps each:

* ``recorded``: ``ddp.train_step`` (the step blocks until its outputs are ready);
* ``direct_blocking``: the underlying jitted step, ``block_until_ready`` after each step;
* ``direct_async``: the underlying jitted step, blocking once per round (steps overlap
  with the next one's dispatch, as an unrecorded step does).

Medians over rounds of the time per step on rank 0; ``JAXPG_FR_BUFFER_SIZE=2000`` is set.

    flock /tmp/jaxpg-bench.lock python bench/recorded_step.py            # about 2 minutes
    flock /tmp/jaxpg-bench.lock python bench/recorded_step.py --hidden 256   # a small model

Writes ``bench/results/recorded_step.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from _launch import RESULTS, launch  # bench/ is sys.path[0]
from _rounds import load_average, run_rounds


def worker(args: argparse.Namespace) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import jaxpg
    from jaxpg.ddp.train_step import StepMode

    jaxpg.init_process_group()
    rank = jaxpg.get_rank()
    h = args.hidden

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(h, h, rngs=rngs)
            self.b = nnx.Linear(h, h, rngs=rngs)

        def __call__(self, x):
            return self.b(jax.nn.relu(self.a(x)))

    ddp = jaxpg.ddp.DistributedDataParallel(MLP(nnx.Rngs(0)), optax.sgd(0.01))

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    batch = {"x": np.ones((32, h), np.float32), "y": np.zeros((32, h), np.float32)}
    for _ in range(3):
        ddp.train_step(loss_fn, batch)
    recorded = ddp._step_fn(loss_fn, StepMode())
    raw = recorded.fn
    from jaxpg.ddp import param_sync

    def direct():
        out = raw(ddp.params, ddp.rest, ddp.opt_state, ddp.hook_state, None,
                  param_sync.shard_batch(batch, ddp.group), None)
        ddp.params, ddp.rest, ddp.opt_state, ddp.hook_state, _, metrics = out
        return metrics

    variants = {
        "recorded": lambda: ddp.train_step(loss_fn, batch),
        "direct_blocking": lambda: jax.block_until_ready(direct()),
        "direct_async": direct,
    }

    def steps(variant):  # ``--steps`` steps, waited for once at the end (run_rounds' wait)
        def run():
            for _ in range(args.steps):
                out = variant()
            return out
        return run

    timed = run_rounds({k: steps(f) for k, f in variants.items()}, args.rounds,
                       barrier=jaxpg.barrier)
    med = {k: t / args.steps * 1e6 for k, t in timed.medians().items()}
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "hidden": h, "params": 2 * (h * h + h), "steps_per_round": args.steps,
            "rounds": args.rounds, "median_us_per_step": med,
            "recorded_vs_direct_blocking": med["recorded"] / med["direct_blocking"],
            "recorded_vs_direct_async": med["recorded"] / med["direct_async"]}))
    jaxpg.barrier()
    jaxpg.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", default=str(RESULTS / "recorded_step.json"))
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    part = Path(args.out).with_suffix(".part.json")
    env = {k: None for k in os.environ if k.startswith(("JAXPG_", "TORCH_"))}
    env["JAXPG_FR_BUFFER_SIZE"] = "2000"
    load_before = load_average()
    launch(__file__, ["--worker", "--hidden", args.hidden, "--steps", args.steps, "--rounds",
                      args.rounds, "--out", part], nproc=2, env=env, timeout=900,
           capture=False, expect=[part])
    result = json.loads(part.read_text())
    part.unlink()
    import jax

    result.update(command="python bench/recorded_step.py " + " ".join(sys.argv[1:]),
                  load_average_before=load_before, load_average_after=load_average(),
                  jax_version=jax.__version__,
                  machine=f"{os.cpu_count()} CPU cores, shared with other jobs")
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {}
    data[f"hidden_{args.hidden}"] = result
    out.write_text(json.dumps(data, indent=1))
    print(json.dumps(result, indent=1))


# python -m bench recorded_step --quick: a short run, written under /tmp unless --out is given
QUICK_ARGS = ["--rounds", "2", "--steps", "5"]

if __name__ == "__main__":
    main()
