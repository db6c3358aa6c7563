"""What the process executor's action programs cost on one core: one process,
one CPU device, the model of ``bench/pipeline_vs_torch.py`` (a stage of ``--layers``
residual MLP blocks of width 512, one dict of arrays per block, microbatches of 32 rows).

Times, each the median of 40 calls blocked on their results: the forward action (keeping
the residuals), the backward action adding into a donated gradient accumulator, the same
without an accumulator, the accumulation alone, with ``remat`` (the backward recomputes
the stage), and the plain forward and ``jax.vjp`` of the stage for comparison. Prints the
figures; docs/pipeline_mp.md cites them.

    python bench/action_program_cost.py [--layers 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the shared helpers

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _pipeline_mp_worker import make_batch, make_params, mse, stage_fn, staged  # noqa: E402

from jaxpg.pipeline.process.action_programs import action_programs  # noqa: E402


def median_ms(fn, n: int = 40) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    layers = parser.parse_args().layers
    pc = jax.tree.map(lambda a: jnp.asarray(a[:1]), staged(make_params(2 * layers, 512), 2))
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), pc)
    x = jnp.asarray(make_batch(32, 512)[0])
    dy = 0.01 * jnp.ones_like(x)
    act = jax.ShapeDtypeStruct(x.shape, x.dtype)
    for remat in (False, True):
        progs = action_programs(stage_fn(layers), mse, None, remat=remat, split_backward=False,
                                one_stage=one, act=act, rows=32)  # fmt: skip
        _, res = progs.forward(pc, x)
        state = {"g": progs.backward(pc, x, dy, res, None)[1]}

        def backward(progs=progs, res=res, state=state):
            out, state["g"] = progs.backward(pc, x, dy, res, state["g"])
            return out

        name = "remat" if remat else "residuals kept"
        print(f"{name}: forward {median_ms(lambda p=progs: p.forward(pc, x)):.2f} ms, "
              f"backward into the accumulator {median_ms(backward):.2f} ms")
        if not remat:
            print(f"  backward without an accumulator "
                  f"{median_ms(lambda p=progs, r=res: p.backward(pc, x, dy, r, None)):.2f} ms")
    add = jax.jit(lambda g, d: jax.tree.map(jnp.add, g, d), donate_argnums=(0,))
    acc, ones = {"g": jax.tree.map(jnp.zeros_like, pc)}, jax.tree.map(jnp.ones_like, pc)

    def accumulate():
        acc["g"] = add(acc["g"], ones)
        return acc["g"]

    print(f"the accumulation alone (g += dp over the stage's parameters): "
          f"{median_ms(accumulate):.2f} ms")
    w = jax.tree.map(lambda a: a[0], pc)
    forward = jax.jit(stage_fn(layers))
    vjp = jax.jit(lambda w, x, g: jax.vjp(stage_fn(layers), w, x)[1](g))
    print(f"plain: forward {median_ms(lambda: forward(w, x)):.2f} ms, "
          f"jax.vjp (forward and backward) {median_ms(lambda: vjp(w, x, dy)):.2f} ms")


if __name__ == "__main__":
    main()
