"""Where ZB-H1's step time goes against 1F1B's: one process, 4 simulated devices.

The model is 4 residual blocks ``x + W2 tanh(W1 x + b1) + b2`` of width ``--dim``, one per
pipeline stage, with a mean squared error; ``m = 8`` microbatches of ``--microbatch`` rows;
the lockstep executor (the call is jitted). Variants, timed in rotating rounds
(``bench/_rounds.py``), each ratio taken round by round against ``1f1b``:

* ``1f1b`` and ``zb_h1`` as they are;
* ``... saved``: the stage split saves every forward value the backward reads, recomputing
  no elementwise operation (``stage_split._elementwise`` patched to ``False`` while tracing),
  to test whether recomputing ``tanh`` in ``B`` is what ZB-H1 pays for;
* ``zb_h1 all-at-once``: ``W`` adds every weight gradient at once instead of one at a time
  under its own ``lax.cond`` (``StagePieces.weight_into``);
* ``pieces``: the stage's jitted pieces on one device, ``F``, the whole backward, and the
  split ``B`` and ``W``, to compare ``B + W`` with the whole backward without the executor.

    python bench/zb_split_cost.py [--dim 512] [--rounds 31]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the shared helpers

import argparse  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _rounds import ratio_median, run_rounds  # noqa: E402
from _stage_pieces import block, piece_variants  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jaxpg.pipeline.lockstep.executor as executor  # noqa: E402
import jaxpg.pipeline.stage.split as stage_split  # noqa: E402
from jaxpg.pipeline import pipeline_value_and_grad  # noqa: E402

P, M = 4, 8


def block_saved(p, x):  # the same math; its own code object, so its own compiled step
    return x + jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def block_all_at_once(p, x):
    return x + jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def mse(_, y, t):
    return jnp.mean((y - t) ** 2)


def _all_at_once(*args, **kwargs):
    pieces = stage_split.split_stage(*args, **kwargs)
    if pieces.weight is None:
        return pieces

    def into(g, p, x, dy, res, wres, go=True):
        return jax.tree.map(jnp.add, g, pieces.weight(p, x, dy, res, wres))

    return pieces._replace(weight_into=into)


def pipeline_variants(dim: int, rows: int) -> dict:
    """``{variant: zero-argument step}``, each compiled (traced under its patch) once."""
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k[0], (P, dim, dim)) / dim**0.5, "b1": jnp.zeros((P, dim)),
              "w2": jax.random.normal(k[1], (P, dim, dim)) / dim**0.5, "b2": jnp.zeros((P, dim))}
    x = jax.random.normal(k[2], (M * rows, dim))
    t = jax.random.normal(k[3], (M * rows, dim))
    mesh = Mesh(np.array(jax.devices()[:P]), ("pp",))
    elementwise, split = stage_split._elementwise, executor.split_stage
    patches = {
        "1f1b": (block, "1f1b", {}), "zb_h1": (block, "zb_h1", {}),
        "1f1b saved": (block_saved, "1f1b", {"_elementwise": lambda eqn: False}),
        "zb_h1 saved": (block_saved, "zb_h1", {"_elementwise": lambda eqn: False}),
        "zb_h1 all-at-once": (block_all_at_once, "zb_h1", {"split_stage": _all_at_once}),
    }
    fns = {}
    for name, (fn, schedule, patch) in patches.items():
        step = jax.jit(lambda p, x, t, fn=fn, schedule=schedule: pipeline_value_and_grad(
            fn, mse, p, x, t, mesh=mesh, schedule=schedule, num_microbatches=M))
        stage_split._elementwise = patch.get("_elementwise", elementwise)
        executor.split_stage = patch.get("split_stage", split)
        try:
            jax.block_until_ready(step(params, x, t))  # traced and compiled under the patch
        finally:
            stage_split._elementwise, executor.split_stage = elementwise, split
        fns[name] = lambda step=step: step(params, x, t)
    return fns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--microbatch", type=int, default=16, help="rows per microbatch")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--out", default="", help="write the results here (JSON)")
    args = parser.parse_args()

    steps = run_rounds(pipeline_variants(args.dim, args.microbatch), args.rounds, iters=3)
    pieces = run_rounds(piece_variants(args.dim, args.microbatch), args.rounds, iters=50)
    ratios = {v: ratio_median(steps.wall[v], steps.wall["1f1b"]) for v in steps.wall}
    med, piece_us = steps.medians(), pieces.medians()
    print(f"dim {args.dim}, microbatch {args.microbatch}, p={P}, m={M}, "
          f"{steps.rounds} rounds, load {steps.load_before} -> {steps.load_after}")
    print("| variant | step ms | / 1f1b (median of rounds) |\n|---|---:|---:|")
    for v in med:
        print(f"| {v} | {med[v] * 1e3:.1f} | {ratios[v]:.3f} |")
    print("| piece (one device) | us |\n|---|---:|")
    for v, s in piece_us.items():
        print(f"| {v} | {s * 1e6:.0f} |")
    split_over_whole = (piece_us["B split"] + piece_us["W"]) / piece_us["B whole"]
    print(f"B split + W over the whole backward: {split_over_whole:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "dim": args.dim, "microbatch": args.microbatch, "p": P, "m": M,
            "ratio_to_1f1b": ratios, "steps": steps.record(1e3, "ms"),
            "pieces": pieces.record(1e6, "us"), "split_over_whole": split_over_whole,
        }, indent=1))


# python -m bench zb_split_cost --quick: a short run, written under /tmp unless --out is given
QUICK_ARGS = ["--rounds", "3"]

if __name__ == "__main__":
    main()
