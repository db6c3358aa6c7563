"""Standalone: a 16 MB all-reduce across processes, XLA:CPU's gloo path against torch's gloo.

Upstream-ready minimal reproduction: it needs only jax (tested with jax/jaxlib 0.10.2);
torch (tested with 2.13.0) is optional and only adds the comparison. Nothing of jaxpg, and
none of bench/'s helpers (``_launch``, ``_rounds``): it starts its processes and times its
variants itself, so that the file can be filed as it is.

Expected: ``jit(shard_map(psum))`` across N processes with
``jax_cpu_collectives_implementation='gloo'`` moves data about as fast as torch's gloo
``all_reduce`` on the same buffer (both use gloo's ring algorithm over the same TCP
transport), and with ``donate_argnums`` at least as fast.

Observed (2-core VM, N = 2, 16 MB float32, median of interleaved calls, same processes):
XLA's psum reaches 0.5-0.8x torch's bus bandwidth; with the input donated it is slower,
not faster. torch made out of place (``all_reduce(t.clone())``) lands where XLA is.
``perf`` puts the difference in a 16 MB ``memcpy`` per call inside
``xla::cpu::AllReduceThunk::Execute`` -> ``GlooCommunicator::AllReduce`` plus a reduction
into a cold, freshly allocated output (two memcpys with donation).

Cause: ``GlooCommunicator::AllReduce`` (``xla/backends/cpu/collectives/gloo_communicator.cc``
in openxla/xla, read at commit 3e1a45f9a740) always calls ``options.setInput(send_buffer)`` and
``options.setOutput(recv_buffer)``; gloo's ring all-reduce then starts by copying the
input into the output. torch passes one buffer (in place). ``GlooCommunicator::
ReduceScatter`` likewise ``memcpy``s the whole input into a fresh ``new char[]`` temporary
first, so ``psum_scatter`` + ``all_gather`` is no way around it (variant ``xla_rs_ag``).
Suggested fix: when buffer assignment lets the all-reduce output alias its operand (or
the operand is donated), pass ``send == recv`` so gloo reduces in place; otherwise
reduce straight from the input in the first ring step instead of copying it first.

It starts N processes on this machine; each joins ``jax.distributed`` (one CPU device per
process) and, when torch is installed, ``torch.distributed`` (gloo), then times, in the
same processes and interleaved round by round after a barrier, these in-process variants
(each call blocks on its result):

* ``torch``: ``dist.all_reduce(t)``, in place (what torch users run);
* ``torch_fresh``: ``dist.all_reduce(t.clone())``: torch made to work like XLA (a fresh
  output buffer and a 16 MB copy per call);
* ``xla_psum``: ``jit(shard_map(psum))`` on a global array (XLA's own floor);
* ``xla_psum_donated``: the same with ``donate_argnums=0`` (``y = f(y)``): can XLA run
  the all-reduce in place?
* ``xla_rs_ag``: ``psum_scatter`` then ``all_gather`` (tiled) in one jit: does the
  reduce-scatter path avoid the full-size copy?
* ``xla_copy``: ``jit(lambda a: a + 0)`` on the same array: no collective, only XLA's
  fresh 16 MB output (allocation, page faults, one copy);
* ``np_fresh``: ``np.ones(4M, float32)``: a fresh, touched 16 MB heap block.

and per call the minor page faults (``getrusage``), voluntary and involuntary context
switches, plus the process's thread count. Without torch, the barrier is a tiny
``psum`` and the ratios are taken against ``xla_psum``. The whole set runs once per
*environment variant* (a fresh group of processes each): the default, glibc's malloc
tunables that keep large blocks in the heap (what jaxpg's launcher sets), the same plus
``glibc.malloc.hugetlb=1`` (transparent huge pages for malloc), jemalloc / tcmalloc
through ``LD_PRELOAD`` (when installed), ``--xla_cpu_multi_thread_eigen=false``.
Environment variants are interleaved too: round r launches every variant once, in a
rotating order.

    python bench/xla_gloo_allreduce_repro.py      # N=2, 16 MB, ~5 min
    python bench/xla_gloo_allreduce_repro.py --nprocs 2 --size 16M --rounds 3 \
        --out bench/results/xla_gloo_allreduce_repro.json

The JSON (``--out``) holds every figure (``--configuration NAME`` writes the run as that
named entry of the file's ``"configurations"`` instead of its top level, keeping the rest);
a summary is printed, ending with the verdict line (XLA psum's bus bandwidth over torch's,
and the memcpy-bound explanation).
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
        "glibc_hugetlb": {"GLIBC_TUNABLES": GLIBC + ":glibc.malloc.hugetlb=1"},
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
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        torch = dist = None
    if args.no_torch:
        torch = dist = None
    rank, n = args.rank, args.nprocs
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args.jax_port}", num_processes=n, process_id=rank)
    if dist is not None:
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
    rs_ag = jax.jit(jax.shard_map(
        lambda a: jax.lax.all_gather(jax.lax.psum_scatter(a, "i", tiled=True), "i", tiled=True),
        mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    copy = jax.jit(lambda a: a + 0)
    g = glob()
    state = {"don": glob()}
    tiny = jax.make_array_from_process_local_data(sh, np.ones(1, np.float32), (n,))

    def donated():
        state["don"] = psum_don(state["don"])
        return state["don"]

    fns = {}
    if dist is not None:
        t = torch.ones(elems)
        fns["torch"] = lambda: dist.all_reduce(t)
        fns["torch_fresh"] = lambda: dist.all_reduce(t.clone())

        def barrier():
            dist.barrier()
    else:
        def barrier():
            psum(tiny).block_until_ready()
    fns.update({
        "xla_psum": lambda: psum(g),
        "xla_psum_donated": donated,
        "xla_rs_ag": lambda: rs_ag(g),
        "xla_copy": lambda: copy(g),
        "np_fresh": lambda: np.ones(elems, np.float32),
    })

    def block(r):
        if hasattr(r, "block_until_ready"):
            r.block_until_ready()

    if args.only:
        fns = {k: fns[k] for k in args.only.split(",")}
    for f in fns.values():
        barrier()
        block(f())
        block(f())
    stats = {v: {"s": [], "minflt": [], "nvcsw": [], "nivcsw": []} for v in fns}
    order = list(fns)
    for r in range(args.inner_rounds):
        rot = order[r % len(order):] + order[: r % len(order)]
        for v in rot:
            barrier()
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
    allst = gather_stats(stats, rank, n, args.child_out)
    if rank == 0:
        out = {"threads": threads, "variants": {},
               "torch_threads": torch.get_num_threads() if torch else None}
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
    barrier()
    if dist is not None:
        dist.destroy_process_group()
    os._exit(0)


def gather_stats(stats: dict, rank: int, n: int, child_out: str) -> list:
    """Every rank's stats on rank 0, through files next to ``child_out`` (no torch needed)."""
    mine = f"{child_out}.rank{rank}"
    with open(mine + ".tmp", "w") as f:
        json.dump(stats, f)
    os.replace(mine + ".tmp", mine)
    if rank != 0:
        return []
    out = []
    for r in range(n):
        path = f"{child_out}.rank{r}"
        deadline = time.monotonic() + 120
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {r} wrote no stats to {path}")
            time.sleep(0.05)
        with open(path) as f:
            out.append(json.load(f))
        os.remove(path)
    return out


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
         str(torch_port), "--child-out", out, "--only", args.only]
        + (["--no-torch"] if args.no_torch else []), env=env)
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


def write_result(path: str, result: dict, configuration: str = "") -> None:
    """Writes ``result`` to ``path``: as the file's top level (its ``"configurations"``
    kept), or as its configuration named ``configuration`` (the rest kept); the layout of
    bench/results/ (bench/_results.py), inlined so that this file stands alone."""
    old = {}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    kept = old.get("configurations", {})
    if configuration:
        data = {**{k: v for k, v in old.items() if k != "configurations"},
                "configurations": {**kept, configuration: result}}
    else:
        data = {**result, "configurations": kept} if kept else result
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


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
    p.add_argument("--configuration", default="", metavar="NAME",
                   help="write into --out's file as this named entry of its "
                        "\"configurations\", keeping the rest of the file")
    p.add_argument("--only", default="", help="comma-separated subset of in-process variants")
    p.add_argument("--perf-dir", default="",
                   help="profile every child with `perf record -e cpu-clock -g` into this dir")
    p.add_argument("--no-torch", action="store_true",
                   help="leave torch out even when installed (the jax-only reproduction)")
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
        ref = "torch" if "torch" in vs else "xla_psum"
        row = {}
        for v in vs:
            times = [x["variants"][v]["time_us"] for x in runs[name]]
            ratios = [x["variants"][ref]["time_us"] / x["variants"][v]["time_us"]
                      for x in runs[name]]
            row[v] = {
                "time_us": statistics.median(times),
                "busbw_GBps": busbw(statistics.median(times)),
                f"busbw_over_{ref}_same_run": statistics.median(ratios),
                "minflt_per_call": statistics.median(
                    x["variants"][v]["minflt_per_call"] for x in runs[name]),
                "nvcsw_per_call": statistics.median(
                    x["variants"][v]["nvcsw_per_call"] for x in runs[name]),
                "nivcsw_per_call": statistics.median(
                    x["variants"][v]["nivcsw_per_call"] for x in runs[name]),
            }
        summary[name] = {"threads": runs[name][0]["threads"], "reference": ref,
                         "variants": row}
    import jax

    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None

    result = {
        "benchmark": "bench/xla_gloo_allreduce_repro.py",
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "jax": jax.__version__, "torch": torch_version,
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                    "shared": "2 cores shared with other tests and benchmarks"},
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
        write_result(args.out, result, args.configuration)
    print(f"\nN={n}, {args.size >> 20} MB, medians (busbw ratio against the reference "
          "variant in the same processes):")
    for name, s in summary.items():
        ref = s["reference"]
        print(f"[{name}] threads={s['threads']} reference={ref}")
        for v, x in s["variants"].items():
            print(f"  {v:18s} {x['time_us'] / 1e3:8.2f} ms  busbw {x['busbw_GBps']:.3f} GB/s "
                  f"ratio {x[f'busbw_over_{ref}_same_run']:.2f}x  faults/call "
                  f"{x['minflt_per_call']:.0f}  nvcsw {x['nvcsw_per_call']:.1f}  "
                  f"nivcsw {x['nivcsw_per_call']:.1f}")

    d = summary.get("default", next(iter(summary.values())))
    v = d["variants"]
    if d["reference"] == "torch" and {"xla_psum_donated", "xla_rs_ag", "torch_fresh"} <= set(v):
        print(f"\nRESULT: XLA psum reaches {v['xla_psum']['busbw_over_torch_same_run']:.2f}x "
              f"torch gloo's bus bandwidth (donated: "
              f"{v['xla_psum_donated']['busbw_over_torch_same_run']:.2f}x, psum_scatter+"
              f"all_gather: {v['xla_rs_ag']['busbw_over_torch_same_run']:.2f}x); torch made "
              f"out of place: {v['torch_fresh']['busbw_over_torch_same_run']:.2f}x. Expected "
              "~1.0x: the gap is GlooCommunicator::AllReduce's input->output copy.")


if __name__ == "__main__":
    main()
