"""What a tensor-parallel stage's actions spend on the host: one process, 8
simulated devices.

A stage of a ``("pp", "tp") = (4, 2)`` mesh holds a Megatron MLP block
``x + down(tanh(up(x)))`` of width ``--dim`` (``up`` column-parallel, ``down``
row-parallel). Each of its actions wraps its activations into arrays on the stage's mesh
(``StageTP.to_global``) and takes this process's shard back (``StageTP.to_local``); that is
host work on the step's path, beside the action's program. Variants, timed in rotating
rounds (``bench/_rounds.py``), each a call blocked on its result:

* ``forward``: the stage's forward action (``stage_programs(...).forward``), wrapping
  included;
* ``to_global``: the wrapping of its input alone;
* ``to_local``: the unwrapping of its output alone.

The ratio ``(to_global + to_local) / forward`` is taken round by round. Writes
``bench/results/tp_stage_host_work.json``.

    python bench/tp_stage_host_work.py [--dim 512] [--rows 16] [--rounds 21]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the shared helpers

import argparse  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _rounds import ratio_median, run_rounds  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpg  # noqa: E402
from jaxpg.pipeline import PipelineStage  # noqa: E402
from jaxpg.pipeline.process.stage_runner import stage_programs  # noqa: E402
from jaxpg.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "tp_stage_host_work.json"


class Mlp(nnx.Module):
    def __init__(self, dim: int):
        rngs = nnx.Rngs(0)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()

    jaxpg.init_process_group()
    mesh = jaxpg.init_device_mesh((4, 2), ("pp", "tp"))
    module = parallelize_module(Mlp(args.dim), mesh["tp"],
                                {"up": ColwiseParallel(), "down": RowwiseParallel()})
    stage = PipelineStage(module, 1, 4, group=mesh["pp"])
    progs = stage_programs(stage, None)
    params, rest = stage.placed(stage.params()), stage.placed(stage.frozen_state())
    x = (jax.device_put(jnp.ones((args.rows, args.dim)), stage.tp.device),)
    out = stage.tp.to_global(progs.forward(params, rest, x)[0])
    rounds = run_rounds({
        "forward": lambda: progs.forward(params, rest, x)[0],
        "to_global": lambda: stage.tp.to_global(x),
        "to_local": lambda: stage.tp.to_local(out),
    }, args.rounds, iters=20, warmup=3)
    share = ratio_median([g + lo for g, lo in zip(rounds.wall["to_global"],
                                                  rounds.wall["to_local"], strict=True)],
                         rounds.wall["forward"])
    result = {"setup": {"dim": args.dim, "rows": args.rows, "tp": 2, "devices": 8,
                        "jax": jax.__version__, "python": sys.version.split()[0]},
              **rounds.record(1e3, "ms"), "host_share_of_forward": share}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    med = rounds.medians()
    print("| variant | median ms |\n|---|---:|")
    for name, t in med.items():
        print(f"| {name} | {t * 1e3:.3f} |")
    print(f"(to_global + to_local) / forward, median over rounds: {share:.3f}")



if __name__ == "__main__":
    main()
