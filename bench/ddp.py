"""DDP benchmark: jaxpg's DistributedDataParallel side by side with torch's, on CPU.

The model is an MLP of about 25M float32 parameters (1024 -> 4096 -> 4096 -> 1024 -> 10,
ReLU), trained with SGD (momentum 0.9) on a cross-entropy loss with a fixed per-rank batch
(32 samples by default). Reported: samples per second (``N x per-rank batch / median step
time``) for

* **torch DDP** (``torch.nn.parallel.DistributedDataParallel``, gloo, ``bucket_cap_mb=25``),
  N = 1 and 2 processes started with ``torch.multiprocessing.spawn``; each process uses
  ``cpu_count // N`` intra-op threads, as torchrun's ``OMP_NUM_THREADS`` default does;
* **jaxpg DDP**, N = 1 and N = 2 in *one process on 2 simulated CPU devices*
  (``--xla_force_host_platform_device_count=2``: both ranks share the process's XLA
  thread pool), and N = 2 across *2 processes* under ``jaxpg-run`` (one device each,
  gloo collectives) unless ``--no-multiprocess``;
* a bucket-size sweep at N = 2 in one process (``bucket_cap_mb`` 1, 5, 25, 100 and one
  bucket holding every gradient) and the reducer against a single fused ``pmean``
  (``reduction='fused_pmean'``: one ``pmean`` per gradient, grouped by XLA's combiner).

Every variant runs ``--warmup`` steps (compilation included) and then ``--steps`` timed
steps, each blocking on the new parameters; the sweep's variants are timed in interleaved
rounds (one step of each per round) so that load from other work hits them alike. On a
2-core machine shared with other work the numbers are noisy and the "distributed" runs
share the same two cores: read them as relative overheads, not as scaling.

    python bench/ddp.py                  # about 2-4 minutes on 2 CPU cores
    python bench/ddp.py --quick          # fewer steps, no sweep repeats

Writes ``bench/results/ddp.json`` and ``bench/results/ddp.png`` and prints a markdown table.
"""

import os

if int(os.environ.get("WORLD_SIZE", "1")) <= 1:  # not under jaxpg-run: 2 simulated devices
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from _launch import LaunchError, free_port, launch  # noqa: E402  (bench/ is sys.path[0])
from _models import LAYERS, MLP, loss_fn, make_batch, n_params, torch_mlp  # noqa: E402
from _rounds import load_average, run_rounds  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpg  # noqa: E402
from jaxpg.ddp import DistributedDataParallel  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def time_jaxpg(group, args, **ddp_kwargs) -> dict:
    """Median step time of jaxpg DDP over ``group``; this process feeds its local ranks."""
    return time_interleaved(group, args, {"": ddp_kwargs})[""]


def time_interleaved(group, args, variants: dict) -> dict:
    """Median step times of several DDP configurations, timed in interleaved rounds.

    Each round runs one step of every variant, so load from other work on a shared
    machine hits them alike.
    """
    n_local = len(group.local_members())
    batch = make_batch(n_local * args.batch, seed=jaxpg.get_rank())
    ddps = {name: DistributedDataParallel(MLP(nnx.Rngs(0)), optax.sgd(0.01, momentum=0.9),
                                          group=group, **kwargs)
            for name, kwargs in variants.items()}
    timed = run_rounds({name: (lambda d=ddp: (d.train_step(loss_fn, batch), d.params)[1])
                        for name, ddp in ddps.items()}, args.steps, warmup=args.warmup)
    out = {}
    for name, step in timed.medians().items():
        out[name] = {"step_ms": 1e3 * step, "samples_per_s": group.size() * args.batch / step,
                     "buckets": len(ddps[name].bucket_plan), **timed.loads()}
    return out


def _torch_worker(rank, world, args, result_path, port):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch_mlp(), bucket_cap_mb=25)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = make_batch(args.batch, seed=rank)
    x, y = torch.from_numpy(batch["x"]), torch.from_numpy(batch["y"]).long()
    def step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    timed = run_rounds({"torch": step}, args.steps, warmup=args.warmup)
    step_s = timed.medians()["torch"]
    if rank == 0:
        Path(result_path).write_text(json.dumps(
            {"step_ms": 1e3 * step_s, "samples_per_s": world * args.batch / step_s,
             "torch": torch.__version__, **timed.loads()}))
    dist.destroy_process_group()


def time_torch(world: int, args) -> dict | None:
    try:
        import torch.multiprocessing as mp
    except ImportError:
        print("torch is not installed: skipping torch DDP (pip install torch==2.13.0)")
        return None
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "torch.json")
        # torch's own spawn, not bench/_launch.launch: torch DDP as torch users start it
        # (no jaxpg world, no jaxpg-run CPU pinning), the worker a function of this file
        mp.spawn(_torch_worker, args=(world, args, path, port), nprocs=world)
        return json.loads(Path(path).read_text())


def time_jaxpg_multiprocess(args) -> dict | None:
    """jaxpg DDP over 2 processes (one device each) under the launcher."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "mp.json")
        try:
            launch(__file__, ["--worker", path, "--batch", args.batch, "--warmup", args.warmup,
                              "--steps", args.steps], nproc=2, env={"XLA_FLAGS": None},
                   timeout=600, expect=[path])
        except LaunchError as err:
            print(f"jaxpg across 2 processes skipped: {err}")
            return None
        return json.loads(Path(path).read_text())


def worker(args) -> None:
    """The body of one process under jaxpg-run (``--worker PATH``)."""
    jaxpg.init_process_group()
    result = time_jaxpg(jaxpg.GroupMember.WORLD, args)
    if jaxpg.get_rank() == 0:
        Path(args.worker).write_text(json.dumps(result))
    jaxpg.destroy_process_group()


def table(result: dict) -> str:
    lines = ["| framework | N | where | buckets | step (ms) | samples/s |",
             "|---|---|---|---|---|---|"]
    for r in result["frameworks"]:
        lines.append(f"| {r['name']} | {r['n']} | {r['where']} | {r.get('buckets', '-')} "
                     f"| {r['step_ms']:.1f} | {r['samples_per_s']:.1f} |")
    lines += ["", "| jaxpg N=2 (one process) | buckets | step (ms) | samples/s |",
              "|---|---|---|---|"]
    for r in result["sweep"]:
        lines.append(f"| {r['name']} | {r['buckets']} | {r['step_ms']:.1f} "
                     f"| {r['samples_per_s']:.1f} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    fw = result["frameworks"]
    labels = [f"{r['name'].split()[0]} N={r['n']}\n{r['where']}".replace("simulated", "sim.")
              for r in fw]
    colors = ["tab:orange" if r["name"].startswith("torch") else "tab:blue" for r in fw]
    ax1.bar(range(len(fw)), [r["samples_per_s"] for r in fw], color=colors)
    ax1.set_xticks(range(len(fw)), labels, fontsize=7, rotation=15)
    ax1.set_ylabel("samples / s")
    ax1.set_title(f"DDP, {result['config']['params'] / 1e6:.1f}M-param MLP, "
                  f"{result['config']['per_rank_batch']} samples/rank, CPU")
    sw = result["sweep"]
    ax2.bar(range(len(sw)), [r["samples_per_s"] for r in sw], color="tab:blue")
    ax2.set_xticks(range(len(sw)), [f"{r['name']}\n({r['buckets']} b.)" for r in sw],
                   fontsize=7)
    ax2.set_ylabel("samples / s")
    ax2.set_title("jaxpg N=2 (one process): bucket cap sweep and fused pmean")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description="jaxpg DDP vs torch DDP on CPU.")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="3 timed steps per variant")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--no-multiprocess", action="store_true")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from --out")
    parser.add_argument("--out", default=str(RESULTS / "ddp.json"))
    args = parser.parse_args()
    if args.quick:
        args.steps = 3
    if args.worker:
        worker(args)
        return
    if args.plot_only:
        result = json.loads(Path(args.out).read_text())
        plot(result, Path(args.out).with_suffix(".png"))
        print(table(result))
        return

    t0, load_before = time.perf_counter(), load_average()
    jaxpg.init_process_group()
    world = jaxpg.GroupMember.WORLD
    frameworks, sweep = [], []
    for n in (1, 2):
        if not args.no_torch:
            r = time_torch(n, args)
            if r is not None:
                frameworks.append({"name": f"torch {r.pop('torch')} DDP", "n": n,
                                   "where": f"{n} proc (gloo)", "buckets": "25MB", **r})
                print(frameworks[-1], flush=True)
        group = world if n == 2 else jaxpg.new_group([0])
        r = time_jaxpg(group, args)
        frameworks.append({"name": "jaxpg DDP", "n": n, "where": "1 proc" + (
            ", 2 sim. devices" if n == 2 else ""), **r})
        print(frameworks[-1], flush=True)
    if not args.no_multiprocess:
        r = time_jaxpg_multiprocess(args)
        if r is not None:
            frameworks.append({"name": "jaxpg DDP", "n": 2, "where": "2 proc (jaxpg-run)", **r})
            print(frameworks[-1], flush=True)
    total_mb = 4 * n_params() / 2**20
    variants = {f"cap {cap} MB": {"bucket_cap_mb": cap} for cap in (1, 5, 25, 100)}
    variants["one bucket"] = {"bucket_cap_mb": 2 * total_mb, "first_bucket_mb": 2 * total_mb}
    variants["fused pmean"] = {"reduction": "fused_pmean"}
    for name, r in time_interleaved(world, args, variants).items():
        kwargs = variants[name]
        if "reduction" in kwargs:
            r["buckets"] = "-"
        sweep.append({"name": name, "bucket_cap_mb": kwargs.get("bucket_cap_mb"), **r})
        print(sweep[-1], flush=True)

    result = {
        "config": {
            "layers": list(LAYERS), "params": n_params(), "per_rank_batch": args.batch,
            "optimizer": "SGD lr 0.01 momentum 0.9", "warmup": args.warmup,
            "steps": args.steps, "cpu_count": os.cpu_count(), "jax": jax.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "jaxpg_one_process": "N=2 on 2 simulated CPU devices in one process",
            "torch_threads": "cpu_count // N per process",
            "wall_s": round(time.perf_counter() - t0, 1),
            "load_average_before": load_before, "load_average_after": load_average(),
        },
        "frameworks": frameworks,
        "sweep": sweep,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(table(result))
    print(f"written to {out} and {out.with_suffix('.png')} in {result['config']['wall_s']}s")
    jaxpg.destroy_process_group()


if __name__ == "__main__":
    main()
