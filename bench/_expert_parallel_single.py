"""One process, 4 simulated CPU devices: ``moe`` step time and per-rank memory by ep and E.

Started by ``bench/expert_parallel.py`` (which reads the JSON this prints last). A step is
``jax.grad`` of ``sum(y · cot) + 0.01 · aux.loss`` in (x, gate_w, w1, w2), per rank, under
``jaxpg.spmd`` and ``jax.jit``; every rank holds ``--tokens`` tokens (weak scaling: the ep
ranks' work runs on the same cores, so a step at ep = 4 does 4x the work of ep = 1).

* ``sweep``: step time and compiled per-device memory (arguments + outputs + temporaries) at
  ep = 1, 2, 4 for each E, dropless;
* ``share``: at each ep > 1, the time of the exchange alone (the dispatch and the combine
  all_to_all, forward and backward, of the same buffers) against the whole step;
* ``capacity``: dropless against capacity factor 1.25, at ep = 4.

Variants are timed round by round in a rotating order; the median of the rounds counts.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _moe import moe_loss, moe_weights  # noqa: E402
from _rounds import run_rounds  # noqa: E402  (bench/ is sys.path[0])

import jaxpg  # noqa: E402


def inputs(ep, experts, args, seed=0):
    """Stacked per-rank arguments: tokens, router, this rank's experts, cotangent."""
    rng = np.random.default_rng(seed)
    t, d, f = args.tokens, args.dim, args.ffn
    gate, w1, w2 = moe_weights(rng, d, f, experts)
    local = experts // ep
    return (jnp.asarray(rng.normal(size=(ep, t, d)).astype(np.float32)),
            jnp.asarray(np.broadcast_to(gate, (ep, d, experts))),
            jnp.asarray(w1.reshape(ep, local, d, f)), jnp.asarray(w2.reshape(ep, local, f, d)),
            jnp.asarray(rng.normal(size=(ep, t, d)).astype(np.float32)))


def moe_step(ep, top_k, capacity_factor, grouped_matmul="auto"):
    """jit(spmd(grad of the loss)) over the first ``ep`` devices."""
    group = jaxpg.new_group(list(range(ep)))

    loss = moe_loss(group, top_k, capacity_factor=capacity_factor,
                    grouped_matmul=grouped_matmul)

    def per_rank(x, gate_w, w1, w2, cot):
        return jax.grad(loss, argnums=(0, 1, 2, 3))(x, gate_w, w1, w2, cot)

    return jax.jit(jaxpg.spmd(per_rank, group=group))


def exchange_step(ep, rows, dim):
    """The exchange alone: dispatch then combine all_to_all of ``(rows, dim)``, and their
    backward (the same four transfers a step makes, without routing or experts)."""
    group = jaxpg.new_group(list(range(ep)))

    def per_rank(buf, cot):
        def loss(buf):
            there = jaxpg.all_to_all_single(buf, group=group)
            back = jaxpg.all_to_all_single(there * 1.5, group=group)
            return jnp.sum(back * cot)
        return jax.grad(loss)(buf)

    return jax.jit(jaxpg.spmd(per_rank, group=group))


def per_device_bytes(step, args_):
    m = step.lower(*args_).compile().memory_analysis()
    return {"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
            "temp_bytes": m.temp_size_in_bytes,
            "total_bytes": m.argument_size_in_bytes + m.output_size_in_bytes
            + m.temp_size_in_bytes}


def timed(variants, rounds):
    """``{name: (fn, args)}`` -> ``{name: {"median_s", "rounds", load averages}}``,
    compiled first (``bench/_rounds.py``)."""
    r = run_rounds({v: (lambda f=f, a=a: f(*a)) for v, (f, a) in variants.items()}, rounds,
                   warmup=1)
    return {v: {"median_s": m, "rounds": r.wall[v], **r.loads()}
            for v, m in r.medians().items()}


def rows_per_rank(ep, experts, top_k, tokens, capacity_factor=None):
    """The exchange buffer's rows per pair of ranks (docs/expert_parallel.md)."""
    local = experts // ep
    s = tokens * min(top_k, local)
    if capacity_factor is not None:
        cap = max(1, int(np.ceil(capacity_factor * tokens * ep * top_k / experts)))
        s = min(s, local * cap)
    return s


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", default=["sweep", "share", "capacity"])
    p.add_argument("--experts", nargs="+", type=int, default=[8, 16])
    p.add_argument("--eps", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    jaxpg.init_process_group()
    out = {"shape": {"tokens_per_rank": args.tokens, "dim": args.dim, "ffn": args.ffn,
                     "top_k": args.top_k}}
    if "sweep" in args.parts:
        rows = []
        for experts in args.experts:
            variants, memory = {}, {}
            for ep in args.eps:
                a = inputs(ep, experts, args)
                step = moe_step(ep, args.top_k, None)
                memory[ep] = per_device_bytes(step, a)
                variants[f"ep{ep}"] = (step, a)
            times = timed(variants, args.rounds)
            for ep in args.eps:
                t = times[f"ep{ep}"]
                rows.append({"experts": experts, "ep": ep, **memory[ep], **t,
                             "tokens_per_s": ep * args.tokens / t["median_s"]})
                print(f"sweep E={experts} ep={ep}: {1e3 * t['median_s']:.1f} ms, "
                      f"{memory[ep]['total_bytes'] / 2**20:.1f} MiB per device", flush=True)
        out["sweep"] = rows
    if "share" in args.parts:
        rows = []
        for experts in args.experts:
            for ep in [e for e in args.eps if e > 1]:
                a = inputs(ep, experts, args)
                s = rows_per_rank(ep, experts, args.top_k, args.tokens)
                buf = jnp.ones((ep, ep * s, args.dim), jnp.float32)
                t = timed({"step": (moe_step(ep, args.top_k, None), a),
                           "exchange": (exchange_step(ep, ep * s, args.dim), (buf, buf))},
                          args.rounds)
                share = t["exchange"]["median_s"] / t["step"]["median_s"]
                rows.append({"experts": experts, "ep": ep, "rows_per_pair": s,
                             "step": t["step"], "exchange": t["exchange"], "share": share})
                print(f"share E={experts} ep={ep}: exchange {share:.0%} of the step", flush=True)
        out["share"] = rows
    if "capacity" in args.parts:
        rows = []
        ep = max(args.eps)
        for experts in args.experts:
            a = inputs(ep, experts, args)
            steps = {"dropless": moe_step(ep, args.top_k, None),
                     "capacity_1.25": moe_step(ep, args.top_k, 1.25)}
            memory = {k: per_device_bytes(s, a) for k, s in steps.items()}
            t = timed({k: (s, a) for k, s in steps.items()}, args.rounds)
            for k in steps:
                cf = None if k == "dropless" else 1.25
                rows.append({"experts": experts, "ep": ep, "mode": k, **t[k], **memory[k],
                             "rows_per_pair": rows_per_rank(ep, experts, args.top_k,
                                                            args.tokens, cf)})
                print(f"capacity E={experts} ep={ep} {k}: {1e3 * t[k]['median_s']:.1f} ms",
                      flush=True)
        out["capacity"] = rows
    jaxpg.destroy_process_group()
    print("JSON " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
