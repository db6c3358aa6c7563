"""Is there a grouped matmul on the GPU that costs what the dense matmul of the same rows
costs? One forward matmul, ``(rows, k) x (E, k, n)`` in ``E`` even groups, bf16:

* ``lax.ragged_dot``: XLA's, as ``jaxpg.expert_parallel`` uses it (in float32 there);
* ``ragged_dot_mgpu``: jax's Pallas/Mosaic GPU kernel for Hopper
  (``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu``), a few block configurations;
* ``dense``: ``(rows, k) x (k, n)``, the floor.

Needs an H100 or H200; prints a markdown table and writes ``--out``.

    python bench/ragged_dot_gpu.py [--rows 16384] [--k 1024] [--n 4096]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp


def timed(fn, *args, iters: int = 20) -> float:
    """Median milliseconds of ``iters`` calls, each waited for, after one warm-up."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    out = {"device": str(jax.devices()[0]), "jax": jax.__version__, "shape": vars(args),
           "rows": []}
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (args.rows, args.k), jnp.bfloat16)
    dense_w = jax.random.normal(kw, (args.k, args.n), jnp.bfloat16)
    dense_ms = timed(jax.jit(jnp.matmul), x, dense_w)
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    except Exception as err:  # noqa: BLE001 (reported, not raised)
        ragged_dot_mgpu, import_error = None, f"{type(err).__name__}: {err}"
    else:
        import_error = None
    for e in args.experts:
        w = jax.random.normal(kw, (e, args.k, args.n), jnp.bfloat16)
        sizes = jnp.full((e,), args.rows // e, jnp.int32)
        ref_fn = jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s))
        ref = ref_fn(x, w, sizes)
        row = {"experts": e, "dense_ms": dense_ms, "lax_ragged_dot_ms": timed(ref_fn, x, w, sizes),
               "mgpu": {}, "mgpu_error": import_error}
        for bm, bn, steps, gbn in ((128, 128, 4, 1), (128, 256, 4, 1), (64, 128, 4, 2)):
            name = f"block_m={bm} block_n={bn} steps={steps} grid_block_n={gbn}"
            if ragged_dot_mgpu is None:
                break
            try:
                kernel = functools.partial(
                    ragged_dot_mgpu.ragged_dot, block_m=bm, block_n=bn, block_k=64,
                    max_concurrent_steps=steps, grid_block_n=gbn)
                fn = jax.jit(lambda x, w, s, kernel=kernel: kernel(x, w, group_sizes=s))
                got = fn(x, w, sizes)
                err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32))))
                row["mgpu"][name] = {"ms": timed(fn, x, w, sizes), "max_abs_diff_vs_lax": err}
            except Exception as err:  # noqa: BLE001
                row["mgpu"][name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    print("| E | dense | lax.ragged_dot | best ragged_dot_mgpu |")
    for row in out["rows"]:
        best = min((v["ms"] for v in row["mgpu"].values() if "ms" in v), default=float("nan"))
        print(f"| {row['experts']} | {row['dense_ms']:.3f} ms | {row['lax_ragged_dot_ms']:.3f} "
              f"ms | {best:.3f} ms |")


if __name__ == "__main__":
    main()
