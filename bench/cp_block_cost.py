"""Why jaxpg's ring attention is slower than a torch P2P ring on CPU: the cost of
one attention block, each side on one thread, in one process.

The 2-process comparison (``bench/context_parallel.py --parts torch``) times whole rings.
Here one block of the ring's forward is timed alone, ``q`` of ``--q`` rows against ``k``/``v``
of ``--k`` rows (``(1, rows, --heads, --dim)``, float32):

* ``jaxpg block``: ``jaxpg.context_parallel.blocks.block_forward`` as the ring runs it
  (heads-major matmuls, the ``(q, d)`` output divided by the row sums);
* ``sequence-major block (before)``: the block as it was written before, its einsums over
  ``(batch, seq, heads, d)`` operands and the ``(q, k)`` probabilities divided;
* ``torch block``: the torch ring's block (``bench/_context_parallel_mp_worker.py``):
  ``matmul``, ``amax``, ``exp``, ``sum``, ``matmul``, then the division of the output;
* ``jax scores matmul`` and ``torch scores matmul``: the first matmul alone.

XLA runs single-threaded (``--xla_cpu_multi_thread_eigen=false``), torch with one thread.

    python bench/cp_block_cost.py [--q 2048] [--k 2048] [--rounds 15]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen="
                           "false intra_op_parallelism_threads=1").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the shared helpers

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from _rounds import ratio_median, run_rounds  # noqa: E402

from jaxpg.context_parallel.blocks import F32, block_forward  # noqa: E402


def sequence_major(q, k, v, scale):
    """The block as it was written before: einsums over (batch, seq, heads, d) operands,
    the probabilities divided before the second matmul."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=F32) * scale
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - m)
    total = jnp.sum(p, axis=-1, keepdims=True)
    return jnp.einsum("bhqk,bkhd->bqhd", p / total, v), (m + jnp.log(total))[..., 0]


def torch_block(q, k, v, scale):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    m = s.amax(-1)
    p = torch.exp(s - m.unsqueeze(-1))
    total = p.sum(-1)
    return torch.matmul(p, v) / total.unsqueeze(-1), m + torch.log(total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--q", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    qn, kn, vn = (rng.normal(size=(1, n, args.heads, args.dim)).astype(np.float32)
                  for n in (args.q, args.k, args.k))
    scale = 1.0 / math.sqrt(args.dim)
    q, k, v = (jnp.asarray(a) for a in (qn, kn, vn))
    tq, tk, tv = (torch.from_numpy(a).transpose(1, 2).contiguous() for a in (qn, kn, vn))
    jb = jax.jit(lambda q, k, v: block_forward(q, k, v, scale))
    ja = jax.jit(lambda q, k, v: sequence_major(q, k, v, scale))
    js = jax.jit(lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k))
    got = [np.asarray(jb(q, k, v)[0]), np.asarray(ja(q, k, v)[0]),
           torch_block(tq, tk, tv, scale)[0].transpose(1, 2).numpy()]
    agree = max(float(np.max(np.abs(g - got[0]))) for g in got[1:])
    with torch.no_grad():
        fns = {"jaxpg block": lambda: jb(q, k, v),
               "sequence-major block (before)": lambda: ja(q, k, v),
               "torch block": lambda: torch_block(tq, tk, tv, scale),
               "jax scores matmul": lambda: js(q, k),
               "torch scores matmul": lambda: torch.matmul(tq, tk.transpose(-1, -2))}
        timed = run_rounds(fns, args.rounds, iters=5, warmup=2)
    ms = {name: t * 1e3 for name, t in timed.medians().items()}
    ratios = {name: ratio_median(timed.wall[name], timed.wall["torch block"])
              for name in fns}
    print(f"q {args.q} x k {args.k}, heads {args.heads}, dim {args.dim}; one thread each; "
          f"outputs agree to {agree:.1e}; load {timed.load_before} -> {timed.load_after}")
    print("| variant | ms | / torch block (median of rounds) |\n|---|---:|---:|")
    for name in fns:
        print(f"| {name} | {ms[name]:.2f} | {ratios[name]:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"shape": vars(args), "ms": ms,
                                              "over_torch_block": ratios, "agree": agree,
                                              **timed.loads()}, indent=1))


# python -m bench cp_block_cost --quick: a short run, written under /tmp unless --out is given
QUICK_ARGS = ["--rounds", "3"]

if __name__ == "__main__":
    main()
