"""Step time during an asynchronous FSDP checkpoint, against a plain step and a synchronous
save, for the GPT of ``bench/fsdp_memory.py`` (``--depth``, ``--d``; default its 110M one).

One process, ``--ranks`` simulated CPU devices, FSDP stage 3 (blocks as units), Adam. Each
round (``bench/_rounds.py``), in a rotating order: a plain step; an asynchronous save (the
time until it returns, the state staged) followed by a step while orbax writes, and the wait
for the rest of the write; a synchronous save. Medians over the rounds; the load average
next to them.

    flock /tmp/jaxpg-bench.lock python bench/async_checkpoint.py --depth 4 --rounds 3

Writes ``bench/results/async_checkpoint.json`` (``--configuration NAME``: as that named
configuration inside it) and prints a markdown table.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import datetime  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _launch import RESULTS  # noqa: E402  (bench/ is sys.path[0])
from _results import add_flag, save  # noqa: E402
from _rounds import medians, run_rounds  # noqa: E402
from _transformer import GPT, SEQ, Block, loss_fn, n_params  # noqa: E402

import jaxpg  # noqa: E402
from jaxpg import fsdp as jfsdp  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--per-rank", type=int, default=1, help="sequences per rank")
    p.add_argument("--out", default=str(RESULTS / "async_checkpoint.json"))
    add_flag(p)
    args = p.parse_args()
    jaxpg.init_process_group()
    group = jaxpg.new_group(list(range(args.ranks)))
    model = GPT(depth=args.depth, d=args.d, heads=max(1, args.d // 64))
    count = n_params(model)
    fsdp = jfsdp.FullyShardedDataParallel(model, optax.adam(1e-4), group=group, units=Block)
    rng = np.random.default_rng(0)
    vocab = model.head.out_features

    def step() -> float:
        batch = {"tokens": rng.integers(0, vocab, (args.ranks * args.per_rank, SEQ + 1),
                                        dtype=np.int32)}
        t = time.perf_counter()
        jax.block_until_ready(fsdp.train_step(loss_fn, batch))
        return time.perf_counter() - t

    root = Path(tempfile.mkdtemp(prefix="jaxpg-async-ckpt-"))
    step(), step()  # compile, warm up
    jfsdp.save_checkpoint(root / "warmup", fsdp, async_save=True)  # orbax's first-call costs
    jfsdp.wait_for_checkpoints()
    jfsdp.save_checkpoint(root / "warmup_sync", fsdp)
    # each variant records the parts of its round; the loop times the whole of each
    times: dict[str, list[float]] = {k: [] for k in (
        "plain_step", "async_save_returns", "step_during_async_write", "async_write_rest",
        "sync_save")}

    def plain():
        times["plain_step"].append(step())

    def async_save():
        t = time.perf_counter()
        jfsdp.save_checkpoint(root / "async", fsdp, async_save=True)
        times["async_save_returns"].append(time.perf_counter() - t)
        times["step_during_async_write"].append(step())
        t = time.perf_counter()
        jfsdp.wait_for_checkpoints()
        times["async_write_rest"].append(time.perf_counter() - t)

    def sync_save():
        step()  # a new step number to save under
        t = time.perf_counter()
        jfsdp.save_checkpoint(root / "sync", fsdp)
        times["sync_save"].append(time.perf_counter() - t)

    def progress(r, _):
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()),
              flush=True)

    timed = run_rounds({"plain": plain, "async": async_save, "sync": sync_save}, args.rounds,
                       progress=progress)
    loads = timed.load
    state_mb = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root / "sync")
                   for f in fs) / 2**20 / max(1, len(os.listdir(root / "sync")))
    shutil.rmtree(root, ignore_errors=True)
    med = medians(times)
    out = {"when": datetime.datetime.now().isoformat(timespec="seconds"),
           "load_average_per_round": loads, **timed.loads(), "jax": jax.__version__,
           "params": count,
           "depth": args.depth, "d": args.d, "ranks": args.ranks, "per_rank": args.per_rank,
           "checkpoint_mib": state_mb, "rounds": times, "median_s": med}
    save(args.out, out, args.configuration)
    print(f"\n{count / 1e6:.0f}M-parameter GPT (depth {args.depth}, d {args.d}), FSDP stage 3 "
          f"on {args.ranks} CPU devices, checkpoint ~{state_mb:.0f} MiB, load "
          f"{min(loads):.1f}-{max(loads):.1f}\n")
    print("| what | median s |\n|---|---:|")
    for k, v in med.items():
        print(f"| {k.replace('_', ' ')} | {v:.2f} |")


# python -m bench async_checkpoint --quick: a short run, written under /tmp unless --out is given
QUICK_ARGS = ["--rounds", "1"]

if __name__ == "__main__":
    main()
