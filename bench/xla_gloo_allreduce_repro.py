"""Standalone: a 16 MB all-reduce across processes, XLA:CPU's gloo path against torch's gloo.

Upstream-ready minimal reproduction (uses only jax and torch; no jaxpg). It starts N
processes on this machine; each joins both ``jax.distributed`` (``jax_cpu_collectives_
implementation='gloo'``, one CPU device per process) and ``torch.distributed`` (gloo), then
times, in the same processes and interleaved round by round after a barrier, these
in-process variants (each call blocks on its result):

* ``torch``: ``dist.all_reduce(t)``, in place (what torch users run);
* ``torch_fresh``: ``dist.all_reduce(t.clone())``: torch made to work like XLA (a fresh
  output buffer and a 16 MB copy per call);
* ``xla_psum``: ``jit(shard_map(psum))`` on a global array (XLA's own floor);
* ``xla_psum_donated``: the same with ``donate_argnums=0`` (``y = f(y)``): can XLA run
  the all-reduce in place?
* ``xla_copy``: ``jit(lambda a: a + 0)`` on the same array: no collective, only XLA's
  fresh 16 MB output (allocation, page faults, one copy);
* ``np_fresh``: ``np.ones(4M, float32)``: a fresh, touched 16 MB heap block.

and per call the minor page faults (``getrusage``), voluntary and involuntary context
switches, plus the process's thread count. The whole set runs once per *environment
variant* (a fresh group of processes each): the default, glibc's malloc tunables that
keep large blocks in the heap, jemalloc / tcmalloc through ``LD_PRELOAD`` (when
installed), ``--xla_cpu_multi_thread_eigen=false``, and torch limited to
cores / N threads. Environment variants are interleaved too: round r launches every
variant once, in a rotating order.

    python bench/xla_gloo_allreduce_repro.py                  # N=2, 16 MB, ~5 min
    python bench/xla_gloo_allreduce_repro.py --nprocs 2 --size 16M --rounds 3 \
        --out bench/results/throughput_breakdown.json

The JSON (``--out``) holds every figure; a summary is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import time

GLIBC = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"
PRELOADS = {
    "jemalloc": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "tcmalloc": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
}


def env_variants() -> dict[str, dict[str, str]]:
    """{name: environment overrides}; an empty string value removes the variable."""
    v = {
        "default": {},
        "glibc_tunables": {"GLIBC_TUNABLES": GLIBC},
        "eigen_single_thread": {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"},
    }
    for name, path in PRELOADS.items():
        if os.path.exists(path):
            v[name] = {"LD_PRELOAD": path}
    return v


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- child


def child(args: argparse.Namespace) -> None:
    import jax
    import numpy as np
    import torch
    import torch.distributed as dist
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    rank, n = args.rank, args.nprocs
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args.jax_port}", num_processes=n, process_id=rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.torch_port}",
                            rank=rank, world_size=n)
    elems = args.size // 4
    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.process_index)), ("i",))
    sh = NamedSharding(mesh, P("i"))
    host = np.ones(elems, np.float32)

    def glob():
        return jax.make_array_from_process_local_data(sh, host, (n * elems,))

    body = jax.shard_map(lambda a: jax.lax.psum(a, "i"), mesh=mesh, in_specs=P("i"),
                         out_specs=P("i"))
    psum = jax.jit(body)
    psum_don = jax.jit(body, donate_argnums=0)
    copy = jax.jit(lambda a: a + 0)
    g = glob()
    state = {"don": glob()}
    t = torch.ones(elems)

    def donated():
        state["don"] = psum_don(state["don"])
        return state["don"]

    fns = {
        "torch": lambda: dist.all_reduce(t),
        "torch_fresh": lambda: dist.all_reduce(t.clone()),
        "xla_psum": lambda: psum(g),
        "xla_psum_donated": donated,
        "xla_copy": lambda: copy(g),
        "np_fresh": lambda: np.ones(elems, np.float32),
    }

    def block(r):
        if hasattr(r, "block_until_ready"):
            r.block_until_ready()

    if args.only:
        fns = {k: fns[k] for k in args.only.split(",")}
    for f in fns.values():
        dist.barrier()
        block(f())
        block(f())
    stats = {v: {"s": [], "minflt": [], "nvcsw": [], "nivcsw": []} for v in fns}
    order = list(fns)
    for r in range(args.inner_rounds):
        rot = order[r % len(order):] + order[: r % len(order)]
        for v in rot:
            dist.barrier()
            u0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            for _ in range(args.iters):
                block(fns[v]())
            dt = (time.perf_counter() - t0) / args.iters
            u1 = resource.getrusage(resource.RUSAGE_SELF)
            st = stats[v]
            st["s"].append(dt)
            st["minflt"].append((u1.ru_minflt - u0.ru_minflt) / args.iters)
            st["nvcsw"].append((u1.ru_nvcsw - u0.ru_nvcsw) / args.iters)
            st["nivcsw"].append((u1.ru_nivcsw - u0.ru_nivcsw) / args.iters)
    threads = len(os.listdir("/proc/self/task"))
    allst = [None] * n
    dist.all_gather_object(allst, stats)
    if rank == 0:
        out = {"threads": threads, "torch_threads": torch.get_num_threads(), "variants": {}}
        for v in fns:
            # a round's time is the slowest rank's; faults and switches are rank 0's
            per_round = [max(s[v]["s"][r] for s in allst) for r in range(args.inner_rounds)]
            out["variants"][v] = {
                "time_us_rounds": [x * 1e6 for x in per_round],
                "time_us": statistics.median(per_round) * 1e6,
                "minflt_per_call": statistics.median(stats[v]["minflt"]),
                "nvcsw_per_call": statistics.median(stats[v]["nvcsw"]),
                "nivcsw_per_call": statistics.median(stats[v]["nivcsw"]),
            }
        with open(args.child_out, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


# ---------------------------------------------------------------------------- parent


def launch(name: str, over: dict[str, str], args: argparse.Namespace, tmp: str) -> dict:
    jax_port, torch_port = free_port(), free_port()
    out = os.path.join(tmp, f"{name}.json")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for k in ("LD_PRELOAD", "GLIBC_TUNABLES"):
        env.pop(k, None)
    env.update(over)
    perf = (["perf", "record", "-q", "-e", "cpu-clock", "-F", "2000", "-g", "-o"]
            if args.perf_dir else [])
    procs = [subprocess.Popen(
        (perf + [os.path.join(args.perf_dir, f"{name}.rank{r}.perf.data")] if perf else [])
        + [sys.executable, __file__, "--child", "--rank", str(r), "--nprocs", str(args.nprocs),
         "--size", str(args.size), "--iters", str(args.iters), "--inner-rounds",
         str(args.inner_rounds), "--jax-port", str(jax_port), "--torch-port",
         str(torch_port), "--child-out", out, "--only", args.only], env=env)
        for r in range(args.nprocs)]
    codes = [p.wait(timeout=args.timeout) for p in procs]
    if any(codes) or not os.path.exists(out):
        raise SystemExit(f"variant {name}: children failed ({codes})")
    with open(out) as f:
        res = json.load(f)
    os.remove(out)
    return res


KEY_SYMBOLS = {
    "__memmove_avx512_unaligned_erms": "memcpy (user space)",
    "gloo::sum<float>": "gloo's reduction (gloo::sum)",
    "_copy_to_iter": "socket receive copies (kernel)",
    "_copy_from_iter": "socket send copies (kernel)",
    "exc_page_fault": "page faults (kernel entry)",
    "clear_page_erms": "zeroing new pages (kernel)",
}


def perf_per_call(data: str, calls: int, hz: int = 2000) -> dict[str, float]:
    """CPU ms per call in the key symbols of one ``perf record`` file (all threads)."""
    rep = subprocess.run(["perf", "report", "-i", data, "-n", "--no-children", "--sort",
                          "sym", "--stdio", "-g", "none"], capture_output=True, text=True)
    out = {}
    for line in rep.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 4 and not line.startswith("#") and parts[1].isdigit():
            sym = " ".join(parts[3:])
            for key, label in KEY_SYMBOLS.items():
                if sym.startswith(key):
                    out[label] = out.get(label, 0.0) + int(parts[1]) * 1e3 / hz / calls
    return out


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--size", default="16M")
    p.add_argument("--iters", type=int, default=5, help="calls per timed block")
    p.add_argument("--inner-rounds", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="launches per environment variant")
    p.add_argument("--variants", default="", help="comma-separated subset of env variants")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default="")
    p.add_argument("--only", default="", help="comma-separated subset of in-process variants")
    p.add_argument("--perf-dir", default="",
                   help="profile every child with `perf record -e cpu-clock -g` into this dir")
    p.add_argument("--child", action="store_true")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--jax-port", type=int, default=0)
    p.add_argument("--torch-port", type=int, default=0)
    p.add_argument("--child-out", default="")
    args = p.parse_args()
    args.size = parse_size(str(args.size))
    if args.child:
        child(args)
        return
    import tempfile

    variants = env_variants()
    if args.variants:
        variants = {k: variants[k] for k in args.variants.split(",")}
    names = list(variants)
    runs: dict[str, list[dict]] = {k: [] for k in names}
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                res = launch(name, variants[name], args, tmp)
                runs[name].append(res)
                v = res["variants"]
                print(f"round {r} {name:20s} " + " ".join(
                    f"{k}={x['time_us'] / 1e3:.1f}ms/{x['minflt_per_call']:.0f}flt"
                    for k, x in v.items()), flush=True)
    n = args.nprocs
    bus = 2 * (n - 1) / n

    def busbw(us: float) -> float:
        return args.size / (us * 1e-6) / 1e9 * bus

    summary = {}
    for name in names:
        vs = runs[name][0]["variants"].keys()
        has_torch = "torch" in vs
        row = {}
        for v in vs:
            times = [x["variants"][v]["time_us"] for x in runs[name]]
            ratios = [x["variants"]["torch"]["time_us"] / x["variants"][v]["time_us"]
                      if has_torch else float("nan") for x in runs[name]]
            row[v] = {
                "time_us": statistics.median(times),
                "busbw_GBps": busbw(statistics.median(times)),
                "busbw_over_torch_same_run": statistics.median(ratios),
                "minflt_per_call": statistics.median(
                    x["variants"][v]["minflt_per_call"] for x in runs[name]),
                "nvcsw_per_call": statistics.median(
                    x["variants"][v]["nvcsw_per_call"] for x in runs[name]),
                "nivcsw_per_call": statistics.median(
                    x["variants"][v]["nivcsw_per_call"] for x in runs[name]),
            }
        summary[name] = {"threads": runs[name][0]["threads"], "variants": row}
    import jax
    import torch

    result = {
        "benchmark": "bench/xla_gloo_allreduce_repro.py",
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "jax": jax.__version__, "torch": torch.__version__,
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                    "shared": "2 cores shared with other helpers' tests and benchmarks"},
        "nprocs": n, "size_bytes": args.size, "iters": args.iters,
        "inner_rounds": args.inner_rounds, "rounds": args.rounds,
        "env_variants": variants,
        "method": ("per env variant, a fresh group of N processes per round (variants "
                   "interleaved in rotating order); inside, the in-process variants are "
                   "interleaved per inner round after a barrier; a round's time is the "
                   "slowest rank's; medians; ratio = torch time / variant time in the same "
                   "processes (busbw ratio), median over launches"),
        "summary": summary, "runs": runs, "wall_s": time.perf_counter() - t0,
    }
    if args.perf_dir:  # the profiles of the last round, rank 0; all samples / timed calls
        calls = args.inner_rounds * args.iters + 2
        result["perf_cpu_ms_per_call_rank0"] = {
            name: perf_per_call(os.path.join(args.perf_dir, f"{name}.rank0.perf.data"), calls)
            for name in names}
        result["perf_note"] = ("perf record -e cpu-clock -F 2000 -g on each child (no hardware "
                               "counters in this VM); CPU ms per call = samples x 0.5 ms / "
                               "calls, all threads; start-up samples are in other symbols")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\nN={n}, {args.size >> 20} MB, medians (busbw over torch in the same processes):")
    for name, s in summary.items():
        print(f"[{name}] threads={s['threads']}")
        for v, x in s["variants"].items():
            print(f"  {v:18s} {x['time_us'] / 1e3:8.2f} ms  busbw {x['busbw_GBps']:.3f} GB/s "
                  f"ratio {x['busbw_over_torch_same_run']:.2f}x  faults/call "
                  f"{x['minflt_per_call']:.0f}  nvcsw {x['nvcsw_per_call']:.1f}  "
                  f"nivcsw {x['nivcsw_per_call']:.1f}")


if __name__ == "__main__":
    main()
