"""What a recorded jitted step costs: DDP's ``train_step`` across 2 processes (gloo), as
jaxpg runs it (a recorded collective call: numbered, in the flight recorder, waited for
with a timeout on the runner thread) against the same compiled step called directly.

In the same processes, rounds alternate three variants of ``steps`` steps each:

* ``recorded``: ``ddp.train_step`` (the step blocks until its outputs are ready);
* ``direct_blocking``: the underlying jitted step, ``block_until_ready`` after each step;
* ``direct_async``: the underlying jitted step, blocking once per round (steps overlap
  with the next one's dispatch, as before issue 22).

Medians over rounds of the time per step on rank 0; ``JAXPG_FR_BUFFER_SIZE=2000`` is set.

    flock /tmp/jaxpg-bench.lock python bench/recorded_step.py            # about 2 minutes
    flock /tmp/jaxpg-bench.lock python bench/recorded_step.py --hidden 256   # a small model

Writes ``bench/results/recorded_step.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
    times: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants)
    for r in range(args.rounds):
        jaxpg.barrier()
        for k in order[r % 3:] + order[:r % 3]:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                out = variants[k]()
            jax.block_until_ready(out)
            times[k].append((time.perf_counter() - t0) / args.steps * 1e6)
    med = {k: statistics.median(v) for k, v in times.items()}
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
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "recorded_step.json"))
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    part = Path(args.out).with_suffix(".part.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXPG_", "TORCH_"))}
    env.update(JAX_PLATFORMS="cpu", JAXPG_FR_BUFFER_SIZE="2000",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    load_before = os.getloadavg()
    subprocess.run([sys.executable, "-m", "jaxpg.run", "--nproc-per-node", "2", __file__,
                    "--worker", "--hidden", str(args.hidden), "--steps", str(args.steps),
                    "--rounds", str(args.rounds), "--out", str(part)], env=env, check=True,
                   timeout=900)
    result = json.loads(part.read_text())
    part.unlink()
    import jax

    result.update(command="python bench/recorded_step.py " + " ".join(sys.argv[1:]),
                  load_average_before=load_before, load_average_after=os.getloadavg(),
                  jax_version=jax.__version__,
                  machine=f"{os.cpu_count()} CPU cores, shared with other jobs")
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {}
    data[f"hidden_{args.hidden}"] = result
    out.write_text(json.dumps(data, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
