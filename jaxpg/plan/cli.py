"""``jaxpg-plan``: rank the layouts of a job, or evaluate one, from the command line.

Examples::

    jaxpg-plan --model llama3-70b --devices 512 --hardware h100-80gb \\
        --seq-len 8192 --global-batch 512
    jaxpg-plan --model gpt-1t --devices 3072 --hardware a100-80gb --seq-len 2048 \\
        --global-batch 3072 --layout "tp=8,pp=64,dp_replicate=6,remat=full,sp=0"
    jaxpg-plan --layers 24 --dim 2048 --heads 16 --ffn 8192 --vocab 50304 --mlp gelu \\
        --devices 8 --hardware local --calibrate --seq-len 1024 --global-batch 64 --json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from jaxpg.plan.estimate import Estimate, evaluate
from jaxpg.plan.hardware import available_hardware, get_hardware
from jaxpg.plan.job import Job
from jaxpg.plan.layout import REMAT_POLICIES, Layout
from jaxpg.plan.presets import available_models, get_model
from jaxpg.plan.search import DEFAULT_SCHEDULES, search
from jaxpg.plan.spec import TransformerSpec

__all__ = ["main", "parser", "table"]

LOCAL_PROFILE = pathlib.Path("~/.cache/jaxpg/local_hardware.toml").expanduser()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxpg-plan", description="Plan a transformer's parallel layout: every layout "
        "that fits, ranked by predicted step time, or one layout evaluated.")
    m = p.add_argument_group("model (a preset, or the sizes)")
    m.add_argument("--model", help=f"a preset: {', '.join(available_models())}")
    for flag in ("layers", "dim", "heads", "kv-heads", "ffn", "vocab", "head-dim", "experts",
                 "top-k", "expert-ffn", "shared-experts", "dense-layers"):
        m.add_argument(f"--{flag}", type=int)
    m.add_argument("--mlp", choices=("swiglu", "gelu"), default=None,
                   help="swiglu (three matrices, the default) or gelu (GPT's two)")
    w = p.add_argument_group("devices and work")
    w.add_argument("--devices", type=int, required=True)
    w.add_argument("--devices-per-node", type=int)
    w.add_argument("--hardware", default="h100-80gb",
                   help=f"a preset ({', '.join(available_hardware())}), 'local', or a TOML "
                   "file")
    w.add_argument("--calibrate", action="store_true",
                   help="measure this machine (matmul throughput, collectives over its "
                   f"devices) and save the 'local' profile to {LOCAL_PROFILE}")
    w.add_argument("--seq-len", type=int, required=True)
    b = w.add_mutually_exclusive_group(required=True)
    b.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    b.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step")
    w.add_argument("--dtype", default="bf16", help="compute dtype (default bf16)")
    w.add_argument("--param-dtype", default="fp32", help="master weights (default fp32)")
    o = p.add_argument_group("search and output")
    o.add_argument("--layout", help='evaluate one layout, e.g. "tp=8,pp=16,dp_shard=64,'
                   'remat=full" (dp_shard defaults to what the other degrees leave)')
    o.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES),
                   help="pipeline schedules to try (comma-separated)")
    o.add_argument("--remat", default=",".join(REMAT_POLICIES),
                   help="recomputation policies to try (comma-separated)")
    o.add_argument("--top", type=int, default=10, help="how many layouts to show (0: all)")
    o.add_argument("--json", action="store_true", help="print a JSON list, best first")
    return p


def _model(args) -> TransformerSpec:
    sizes = {k: getattr(args, k) for k in ("layers", "dim", "heads", "kv_heads", "ffn",
                                           "vocab", "head_dim", "experts", "top_k",
                                           "expert_ffn", "shared_experts", "dense_layers")}
    given = {k: v for k, v in sizes.items() if v is not None}
    if args.mlp:
        given["mlp"] = args.mlp
    if args.model:
        import dataclasses

        return dataclasses.replace(get_model(args.model), **given) if given else get_model(
            args.model)
    missing = [f"--{k.replace('_', '-')}" for k in ("layers", "dim", "heads", "ffn", "vocab")
               if k not in given]
    if missing:
        raise SystemExit(f"jaxpg-plan: give --model or all of {', '.join(missing)}.")
    return TransformerSpec(**given)


def _hardware(args):
    if args.calibrate:
        from jaxpg.plan.calibrate import calibrate
        from jaxpg.plan.hardware import save_hardware

        profile = calibrate()
        save_hardware(profile, LOCAL_PROFILE)
        print(f"calibrated: {profile}", file=sys.stderr)
        return profile
    if args.hardware == "local":
        if not LOCAL_PROFILE.is_file():
            raise SystemExit(f"jaxpg-plan: no local profile at {LOCAL_PROFILE}; run with "
                             "--calibrate first.")
        return get_hardware(str(LOCAL_PROFILE))
    return get_hardware(args.hardware)


def table(estimates: list[Estimate]) -> str:
    """The ranked layouts as a text table."""
    head = (f"{'#':>3} {'dp_rep':>6} {'dp_shd':>6} {'cp':>3} {'tp':>3} {'pp':>3} {'ep':>3} "
            f"{'mb':>5} {'schedule':<16} {'remat':<9} {'zero':>4} {'GiB':>7} {'step s':>9} "
            f"{'bubble':>7} {'comm':>7} {'tok/s/dev':>10} {'MFU':>6}")
    rows = [head, "-" * len(head)]
    for i, e in enumerate(estimates, 1):
        lay, t = e.layout, e.time
        sched = lay.schedule + (f"/v{lay.chunks}" if lay.chunks > 1 else "")
        rows.append(
            f"{i:>3} {lay.dp_replicate:>6} {lay.dp_shard:>6} {lay.cp:>3} {lay.tp:>3} "
            f"{lay.pp:>3} {lay.ep:>3} {lay.microbatches:>5} {sched:<16} {lay.remat:<9} "
            f"{lay.zero:>4} {e.memory.total_gib:>7.1f} {e.step_s:>9.4g} {t.bubble:>7.3g} "
            f"{t.exposed_comm:>7.3g} {e.tokens_per_s_per_device:>10,.0f} {e.mfu:>6.1%}")
    return "\n".join(rows)


def _layout(text: str, job: Job) -> Layout:
    lay = Layout.parse(text)
    keys = {item.split("=")[0].strip() for item in text.split(",") if "=" in item}
    if not keys & {"dp_shard", "fsdp", "sharding"} and lay.devices != job.devices:
        others = lay.devices
        if job.devices % others == 0:
            lay = lay.replace(dp_shard=job.devices // others, zero=None)
    if not keys & {"microbatches", "m"}:  # one sequence per microbatch
        per = job.global_batch // lay.dp
        if per >= 1:
            lay = lay.replace(microbatches=per)
    return lay


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    model = _model(args)
    hardware = _hardware(args)
    batch = args.global_batch
    if batch is None:
        if args.global_batch_tokens % args.seq_len:
            raise SystemExit(f"jaxpg-plan: --global-batch-tokens {args.global_batch_tokens} "
                             f"is not a multiple of --seq-len {args.seq_len}.")
        batch = args.global_batch_tokens // args.seq_len
    job = Job(model=model, devices=args.devices, hardware=hardware, seq_len=args.seq_len,
              global_batch=batch, devices_per_node=args.devices_per_node, dtype=args.dtype,
              param_dtype=args.param_dtype)
    if args.layout:
        est = evaluate(_layout(args.layout, job), job)
        print(json.dumps([est.to_json()], indent=1) if args.json else
              f"{model.describe()}\n{est.summary()}")
        return 0 if est.fits else 1
    schedules = tuple(s for s in args.schedules.split(",") if s)
    remats = tuple(r for r in args.remat.split(",") if r)
    found = search(job, top=args.top or None, schedules=schedules, remats=remats)
    if args.json:
        print(json.dumps([e.to_json() for e in found], indent=1))
    elif not found:
        print(f"{model.describe()}\nNo layout fits {args.devices} x {hardware.name}; "
              "evaluate one with --layout to see why.")
    else:
        print(f"{model.describe()}\n{job.devices} x {hardware.name}, seq {job.seq_len}, "
              f"global batch {job.global_batch}\n{table(found)}")
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
