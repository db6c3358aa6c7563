"""Context parallelism on simulated CPU devices (one process): memory and step time.

* ``memory``: XLA's compiled memory analysis (per device) of one attention forward +
  backward (ring, causal, load-balanced) at the given sequence lengths for cp = 1, 2, 4:
  arguments + outputs + temporaries. Nothing runs; only compiles.
* ``methods``: step time (forward + backward) of ring vs all_to_all vs all_gather, causal and
  load-balanced, at cp = 4.
* ``balance``: causal ring with vs without load balancing at cp = 4.
* ``torch``: across 2 processes (``bench/_context_parallel_mp_worker.py`` under jaxpg-run),
  jaxpg's causal load-balanced ring forward against a ring written with torch.distributed
  P2P on gloo, in the same processes on the same shards (both checked against numpy), and
  against jaxpg's ring on the contiguous layout (the balance, one core per rank).

Timings alternate the variants round by round (``bench/_rounds.py``) and report the median;
the machine is shared, so read the ratios, and the load average recorded beside them.

    flock /tmp/jaxpg-bench.lock python bench/context_parallel.py --seqs 4096 16384 65536
    flock /tmp/jaxpg-bench.lock python bench/context_parallel.py --parts methods balance
    flock /tmp/jaxpg-bench.lock python bench/context_parallel.py --parts torch --seq 4096

Writes ``bench/results/context_parallel.json`` and prints markdown tables.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _launch import BENCH, RESULTS, free_port, launch  # noqa: E402  (bench/ is sys.path[0])
from _rounds import load_average, run_rounds  # noqa: E402

import jaxpg  # noqa: E402
from jaxpg import context_parallel as cp_  # noqa: E402


def step_fn(n, method, causal, load_balance):
    """jit(grad of sum(attention)) over ``n`` stacked ranks, and its input shapes."""
    group = jaxpg.new_group(list(range(n)))

    def loss(q, k, v):
        o = cp_.attention(q, k, v, group=group, causal=causal, method=method,
                          load_balance=load_balance)
        return jnp.sum(o.astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def shapes(n, seq, batch, heads, dim):
    return jax.ShapeDtypeStruct((n, batch, seq // n, heads, dim), jnp.float32)


def memory(seqs, args):
    rows = []
    for seq in seqs:
        for n in (1, 2, 4):
            s = shapes(n, seq, args.batch, args.heads, args.dim)
            compiled = step_fn(n, "ring", True, True).lower(s, s, s).compile()
            m = compiled.memory_analysis()
            total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            rows.append({"seq": seq, "cp": n, "argument_bytes": m.argument_size_in_bytes,
                         "output_bytes": m.output_size_in_bytes,
                         "temp_bytes": m.temp_size_in_bytes, "total_bytes": total})
            print(f"memory seq={seq} cp={n}: {total / 2**20:.1f} MiB per device", flush=True)
    return rows


def timed(variants, args):
    inputs = {}
    for name, (n, method, causal, lb) in variants.items():
        key = jax.random.PRNGKey(0)
        s = shapes(n, args.seq, args.batch, args.heads, args.dim).shape
        q, k, v = (jax.random.normal(jax.random.fold_in(key, i), s) for i in range(3))
        f = step_fn(n, method, causal, lb)
        inputs[name] = lambda f=f, a=(q, k, v): f(*a)
    r = run_rounds(inputs, args.rounds, warmup=1)  # the warm-up call compiles
    return {v: {"median_s": m, "rounds": r.wall[v]} for v, m in r.medians().items()}


def against_torch(args):
    """The 2-process comparison (each process holds one CPU device: bench/_launch.py
    leaves out this process's simulated-device flag)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cp_torch.json")
        done = launch(BENCH / "_context_parallel_mp_worker.py",
                      ["--torch-port", free_port(), "--seq", args.seq, "--batch", args.batch,
                       "--heads", args.heads, "--dim", args.dim, "--rounds", args.rounds,
                       "--out", out], nproc=2, expect=[out], what="torch part")
        if "AGREE False" in (done.output or ""):
            raise SystemExit(f"torch part: jaxpg and torch disagree:\n{done.tail()}")
        return json.loads(Path(out).read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", nargs="+", default=["memory", "methods", "balance"])
    parser.add_argument("--seqs", nargs="+", type=int, default=[4096, 16384, 65536])
    parser.add_argument("--seq", type=int, default=2048, help="sequence for the timings")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "context_parallel.json"),
                        help="the results file; the parts run are replaced in it")
    args = parser.parse_args()
    jaxpg.init_process_group()
    path = Path(args.out)
    out = json.loads(path.read_text()) if path.exists() else {}
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "jax": jax.__version__, "argv": sys.argv[1:], "shape": {
                "batch": args.batch, "heads": args.heads, "head_dim": args.dim},
            "loadavg_before": load_average()}
    if "memory" in args.parts:
        out["memory"] = {"meta": meta, "rows": memory(args.seqs, args)}
    if "methods" in args.parts:
        out["methods"] = {"meta": meta, "seq": args.seq, "cp": 4, "times": timed({
            m: (4, m, True, True) for m in ("ring", "all_to_all", "all_gather")}, args)}
    if "balance" in args.parts:
        out["balance"] = {"meta": meta, "seq": args.seq, "cp": 4, "times": timed({
            "balanced": (4, "ring", True, True), "contiguous": (4, "ring", True, False)},
            args)}
    if "torch" in args.parts:
        out["torch"] = {"meta": meta, **against_torch(args)}
        t = out["torch"]
        print(f"torch cp=2 forward: torch {t['forward_ms']['torch']:.1f} ms, jaxpg "
              f"{t['forward_ms']['jaxpg']:.1f} ms ({t['jaxpg_over_torch_time']:.2f}x); jaxpg "
              f"contiguous {t['forward_ms']['jaxpg contiguous']:.1f} ms (balanced / "
              f"contiguous {t['balanced_over_contiguous_per_round_median']:.2f})", flush=True)
    for part in ("methods", "balance"):
        if part in out and part in args.parts:
            out[part]["meta"]["loadavg_after"] = load_average()
            for v, t in out[part]["times"].items():
                print(f"{part} {v}: {1e3 * t['median_s']:.1f} ms", flush=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    jaxpg.destroy_process_group()


# python -m bench context_parallel --quick: a short run, written under /tmp unless --out is given
QUICK_ARGS = ["--rounds", "1"]

if __name__ == "__main__":
    main()
