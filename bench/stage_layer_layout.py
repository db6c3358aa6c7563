"""How a stage holds its layers' parameters, and what its step costs: one
process, one CPU device.

A stage of ``--layers`` residual MLP blocks ``x + W2 gelu(W1 x + b1) + b2`` (width
``--dim``, hidden ``4 dim``; the model of ``bench/pipeline_vs_torch.py``), loss and
gradients of one microbatch of ``--rows`` rows, jitted. Variants, timed in rotating rounds
(``bench/_rounds.py``):

* ``list``: one dict of arrays per layer (as torch holds one ``Linear`` per layer);
* ``stacked``: every layer's arrays in one ``[layers, ...]`` array, each layer sliced out
  (``w[i]``) inside the step, so the backward scatters each layer's gradient into the stack;
* ``scan``: the stacked arrays through ``lax.scan`` over the layers;
* ``torch``: the same stage in torch (one thread), when torch is installed.

Ratios to ``list`` are taken round by round. Writes ``bench/results/stage_layer_layout.json``
(the Python and jax versions in its ``setup``; ``--configuration newest_jax``: the run under
the newest jax, ``.venv313``, kept beside the default one).

    python bench/stage_layer_layout.py [--layers 2] [--dim 512] [--rows 32]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the shared helpers

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _pipeline_mp_worker import block, make_batch, make_params, mse, per_block, stage_fn  # noqa: E402
from _results import add_flag, save  # noqa: E402
from _rounds import ratio_median, run_rounds  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "stage_layer_layout.json"


def variants(layers: int, dim: int, rows: int) -> dict:
    """name -> a call that runs one step and returns its result (blocked on by the rounds)."""
    host = make_params(layers, dim)
    stacked = jax.tree.map(jnp.asarray, host)
    listed = jax.tree.map(jnp.asarray, per_block(host))
    x, t = (jnp.asarray(a) for a in make_batch(rows, dim))

    def sliced(w, x, t):
        for i in range(layers):
            x = block(jax.tree.map(lambda a, i=i: a[i], w), x)
        return mse(None, x, t)

    def scanned(w, x, t):
        x, _ = jax.lax.scan(lambda h, wi: (block(wi, h), None), x, w)
        return mse(None, x, t)

    steps = {
        "list": (jax.jit(jax.value_and_grad(lambda w, x, t: mse(None, stage_fn(layers)(w, x),
                                                                  t))), listed),
        "stacked": (jax.jit(jax.value_and_grad(sliced)), stacked),
        "scan": (jax.jit(jax.value_and_grad(scanned)), stacked),
    }
    out = {name: (lambda f=f, w=w: f(w, x, t)) for name, (f, w) in steps.items()}
    try:
        import torch
    except ImportError:
        return out
    from _pipeline_mp_worker import torch_variant

    torch.set_num_threads(1)
    whole = torch_variant("baseline", 0, 1, 1, host, *make_batch(rows, dim))[0]
    out["torch"] = lambda: whole() or jnp.zeros(())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=11)
    add_flag(parser)
    args = parser.parse_args()

    fns = variants(args.layers, args.dim, args.rows)
    rounds = run_rounds(fns, args.rounds, iters=10, warmup=2)
    ratios = {f"{name} / list": ratio_median(rounds.wall[name], rounds.wall["list"])
              for name in fns if name != "list"}
    result = {"setup": {"layers": args.layers, "dim": args.dim, "rows": args.rows,
                        "jax": jax.__version__, "python": sys.version.split()[0]},
              **rounds.record(1e3, "ms"), "ratios": ratios}
    path = save(RESULTS, result, args.configuration)
    print("| variant | median ms |\n|---|---:|")
    for name, t in rounds.medians().items():
        print(f"| {name} | {t * 1e3:.2f} |")
    for name, r in ratios.items():
        print(f"{name}, median over rounds: {r:.2f}")
    print(f"written to {path}")



if __name__ == "__main__":
    main()
