"""The experts' MLP as one tiled loop against two grouped matmuls, on CPU, side by side.

``jaxpg.expert_parallel.grouped_mlp`` runs ``activation(rows @ w1[e]) @ w2[e]`` as one loop
over the tiles that hold routed rows (the ``"fused"`` variant); before it, the experts ran two
tiled grouped matmuls with the activation over the whole dispatch buffer between them
(``"separate"``). Two parts, each timed in rotating rounds (``bench/_rounds.py``), CPU time:

* ``mlp`` (one device): the MLP's gradient step alone on the buffer ``moe`` gives the experts
  at ep = 1, 2, 4 and 8 (``ep · tokens · min(top_k, E / ep)`` rows, of which
  ``tokens · top_k`` are routed, in even groups over the ``E / ep`` local experts);
* ``step`` (8 simulated devices): the planner's MoE trial step
  (``jaxpg.plan.trial.compile_trial``, ``bench/_planner_cases.py``'s model; ZeRO-1,
  ``dp_shard = 8``) at the same ep, with ``dispatch.grouped_mlp`` patched to the separate
  form while tracing for ``"separate"``; its figure is one device's CPU seconds.

    python bench/grouped_mlp.py [--rounds 7] [--parts mlp step]

Writes ``bench/results/grouped_mlp.json`` (``--configuration NAME``: as that configuration).
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

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _launch import RESULTS  # noqa: E402
from _planner_cases import MOE  # noqa: E402
from _results import add_flag, save  # noqa: E402
from _rounds import ratio_median, run_rounds  # noqa: E402

import jaxpg.expert_parallel.dispatch as dispatch  # noqa: E402
from jaxpg.expert_parallel.grouped_mlp import grouped_mlp, separate_mlp  # noqa: E402

QUICK_ARGS = ["--rounds", "2", "--eps", "1", "4"]
TOKENS = 256  # a device's tokens in the planner's MoE trial (16 x 128 over 8 devices)


VARIANTS = {"separate": separate_mlp, "fused": grouped_mlp}


def mlp_steps(ep: int) -> dict:
    """``{variant: step}``: the MLP's gradient on ep's worst-case buffer."""
    s = MOE
    local = s.experts // ep
    rows = ep * TOKENS * min(s.top_k, local)
    routed = TOKENS * s.top_k
    sizes = jnp.full((local,), routed // local, jnp.int32)
    k = jax.random.split(jax.random.key(0), 3)
    x = jnp.where(jnp.arange(rows)[:, None] < routed,
                  jax.random.normal(k[0], (rows, s.dim)), 0.0)
    w1 = jax.random.normal(k[1], (local, s.dim, s.expert_ffn)) / s.dim ** 0.5
    w2 = jax.random.normal(k[2], (local, s.expert_ffn, s.dim)) / s.expert_ffn ** 0.5
    steps = {}
    for name, fn in VARIANTS.items():
        grad = jax.jit(jax.grad(
            lambda x, w1, w2, fn=fn: jnp.sum(fn(x, w1, w2, sizes, jax.nn.gelu, "tiled") ** 2),
            argnums=(0, 1, 2)))
        compiled = grad.lower(x, w1, w2).compile()
        steps[name] = lambda c=compiled: c(x, w1, w2)
    return {"rows": rows, "routed": routed, "steps": steps}


def trial_steps(ep: int) -> dict:
    """``{variant: step}``: the planner's MoE trial step at ``dp_shard=8, ep``, ZeRO-1."""
    from jaxpg.plan import Job, Layout, get_hardware
    from jaxpg.plan.trial import compile_trial

    job = Job(model=MOE, devices=8, hardware=get_hardware("h100-80gb"), seq_len=128,
              global_batch=16, dtype="fp32", param_dtype="fp32")
    layout = Layout(dp_shard=8, ep=ep, zero=1)
    steps, original = {}, dispatch.grouped_mlp
    try:
        for name, fn in VARIANTS.items():
            dispatch.grouped_mlp = fn  # what expert_ffn calls while the step is traced
            trial = compile_trial(job, layout)
            steps[name] = lambda t=trial: t.step()
    finally:
        dispatch.grouped_mlp = original
    return {"layout": str(layout), "steps": steps}


def timed(parts: dict[int, dict], rounds: int, per_device: float) -> dict:
    fns = {f"ep{ep} {name}": fn for ep, part in parts.items()
           for name, fn in part["steps"].items()}
    result = run_rounds(fns, rounds, warmup=1)
    cpu = {k: min(v) / per_device for k, v in result.cpu.items()}
    rows = []
    for ep, part in parts.items():
        info = {k: v for k, v in part.items() if k != "steps"}
        sep, fus = result.cpu[f"ep{ep} separate"], result.cpu[f"ep{ep} fused"]
        rows.append({"ep": ep, **info, "separate_ms": cpu[f"ep{ep} separate"] * 1e3,
                     "fused_ms": cpu[f"ep{ep} fused"] * 1e3,
                     "fused_over_separate": ratio_median(fus, sep)})
    return {"rows": rows, "rounds": rounds, **result.loads()}


def table(rows: list[dict]) -> str:
    lines = ["| ep | separate | fused | fused / separate (per round) |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['ep']} | {r['separate_ms']:.2f} ms | {r['fused_ms']:.2f} ms | "
              f"{r['fused_over_separate']:.2f}x |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--eps", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--parts", nargs="+", choices=("mlp", "step"), default=["mlp", "step"])
    p.add_argument("--out", type=Path, default=RESULTS / "grouped_mlp.json")
    add_flag(p)
    args = p.parse_args(argv)
    out = {"jax": jax.__version__, "tokens": TOKENS, "model": MOE.describe()}
    if "mlp" in args.parts:
        out["mlp"] = timed({ep: mlp_steps(ep) for ep in args.eps}, args.rounds, 1.0)
        print("the experts' MLP alone (gradient step, CPU ms)\n" + table(out["mlp"]["rows"]))
    if "step" in args.parts:
        out["step"] = timed({ep: trial_steps(ep) for ep in args.eps}, args.rounds, 8.0)
        print("the planner's MoE trial step (CPU ms per device)\n" + table(out["step"]["rows"]))
    save(args.out, out, args.configuration)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
