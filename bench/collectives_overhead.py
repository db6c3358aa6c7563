"""Eager overhead with one rank per process: jaxpg's call against a hand-written
``jax.jit(jax.shard_map(...))`` of the same ``lax`` op, side by side in the same process.

Layouts (each a fresh set of processes, one CPU device each):

* ``single``: ``init_process_group()`` in one process with one device;
* ``tcp1``: ``init_process_group(init_method="tcp://...", world_size=1, rank=0)``, the
  torch layout with a world of one (a multi-process world: store, progress, semantics);
* ``mp2``: two processes, one rank each (gloo under XLA), started by ``jaxpg.run``; its
  rows also time the eager call with the default signature check turned off in the same
  processes (``eager_nocheck``): ``check_us``, the median over rounds of the round's
  eager-minus-unchecked difference, is the check's cost per call;
* ``mp2_detail``: the same with ``JAXPG_DEBUG=DETAIL`` (the fingerprint exchange through
  the store before every collective): its ``eager - hand`` is DETAIL's per-call cost plus
  the plain overhead.

For each op (``all_reduce``, ``all_gather_into_tensor``, ``broadcast``) and size, a round
calls each variant ``iters`` times back to back, blocking on every result, in a rotating
order; the times are medians over rounds of the time per call, on rank 0, and the overhead
is the median over rounds of the round's eager-minus-hand difference (load from other work
that hits a round hits both variants). The hand-written
kernel takes an input that is already a global array (no host work per call). Also timed at
the smallest size: the time until the call returns (``dispatch``).

    python bench/collectives_overhead.py              # about 5 minutes
    python bench/collectives_overhead.py --quick      # 1K and 1M, fewer rounds
    python bench/collectives_overhead.py --sizes 1K --layouts single,mp2 \
        --configuration signature_check  # the check's cost, an entry of the same file
    python bench/collectives_overhead.py --fr-probe   # the flight recorder's cost per call
    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=1 \
        python bench/collectives_overhead.py --spin-probe 64K   # see spin_probe()

Writes ``bench/results/collectives_overhead.json`` (``--configuration NAME``: as that named
configuration inside it; the probes add to its default run) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from _launch import RESULTS, free_port, launch  # bench/ is sys.path[0]
from _results import add_flag, save
from _rounds import block, diff_median, load_average, no_wait, run_rounds
from _sizes import fmt_size, parse_size

OPS = ("all_reduce", "all_gather_into_tensor", "broadcast")


def worker(args: argparse.Namespace) -> None:
    """Runs in each process of a layout; rank 0 writes its figures to ``args.out``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxpg
    from jaxpg.supervision import collective_call

    if args.layout == "tcp1":
        jaxpg.init_process_group(init_method=f"tcp://127.0.0.1:{free_port()}",
                                 world_size=1, rank=0)
    else:
        jaxpg.init_process_group()
    rank, n = jaxpg.get_rank(), jaxpg.get_world_size()
    mesh = Mesh(np.array(jax.devices()), ("i",))
    sharding = NamedSharding(mesh, P("i"))
    dev = jax.local_devices()[0]

    def smap(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("i"), out_specs=P("i")))

    hands = {
        "all_reduce": smap(lambda x: lax.psum(x, "i")),
        "all_gather_into_tensor": smap(lambda x: lax.all_gather(x, "i", tiled=True)),
        "broadcast": smap(lambda x: lax.psum(
            jnp.where(lax.axis_index("i") == 0, x, jnp.zeros_like(x)), "i")),
    }
    eagers = {
        "all_reduce": jaxpg.all_reduce,
        "all_gather_into_tensor": jaxpg.all_gather_into_tensor,
        "broadcast": lambda x: jaxpg.broadcast(x, src=0),
    }
    rows = []
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    checked = n > 1 and collective_call._signatures  # the default signature check is on

    def setup(variant: str) -> None:  # both ranks switch it alike before every sample
        collective_call._signatures = checked and variant != "eager_nocheck"

    for op in args.ops.split(","):
        for size in sizes:
            elems = size // 4 // (n if op == "all_gather_into_tensor" else 1)
            host = np.full(elems, rank + 1, np.float32)
            x = jax.device_put(host, dev)
            glob = jax.make_array_from_process_local_data(sharding, host, (n * elems,))
            fns = {"hand": lambda h=hands[op], g=glob: h(g),
                   "eager": lambda e=eagers[op], x=x: e(x)}
            if checked:  # the same call, the default signature check off
                fns["eager_nocheck"] = fns["eager"]

            want = np.asarray(jax.device_get(fns["hand"]().addressable_data(0)))
            got = np.asarray(jax.device_get(fns["eager"]()))
            assert np.allclose(got.reshape(want.shape), want), (op, size)
            iters = max(3, min(100, (4 << 20) // size))
            timed = run_rounds(fns, args.rounds, iters=iters, barrier=jaxpg.barrier,
                               setup=setup)
            times = timed.wall
            med = {k: v * 1e6 for k, v in timed.medians().items()}
            # the median of each round's difference: load that hits a round hits both
            diff = diff_median(times["eager"], times["hand"]) * 1e6
            cpu = {k: v * 1e6 for k, v in timed.medians(cpu=True).items()}  # load hides less
            row = {"op": op, "size_bytes": size, "iters": iters, "rounds": args.rounds,
                   "median_us": med, "cpu_median_us": cpu, "overhead_us": diff,
                   "overhead_pct": diff / med["hand"] * 100, **timed.loads()}
            if checked:
                row["check_us"] = diff_median(times["eager"], times["eager_nocheck"]) * 1e6
                row["check_cpu_us"] = diff_median(timed.cpu["eager"],
                                                  timed.cpu["eager_nocheck"]) * 1e6
            if size == min(sizes):  # the time until the call returns
                disp = run_rounds(fns, args.rounds * 20, wait=no_wait, settle=block,
                                  setup=setup)
                row["dispatch_us"] = {k: v * 1e6 for k, v in disp.medians().items()}
            rows.append(row)
            if rank == 0:
                check = f", check {row['check_us']:+.1f} us" if checked else ""
                print(f"{args.layout} {op} {fmt_size(size)}: hand {med['hand']:.1f} us, "
                      f"eager {med['eager']:.1f} us{check}", flush=True)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"layout": args.layout, "n": n, "rows": rows}))
    jaxpg.barrier()
    jaxpg.destroy_process_group()


def spin_probe(size: int, rounds: int = 30) -> dict:
    """One device, one process: the hand-written psum, the same after ~6 µs of Python busy
    work per call (what the eager path adds), the eager path's own compiled kernel called
    directly, and the eager call, interleaved; median µs per blocking call
    (``--spin-probe``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxpg
    from jaxpg.collectives import eager

    jaxpg.init_process_group()
    dev = jax.devices()[0]
    mesh = Mesh(np.array([dev]), ("i",))
    hand = jax.jit(jax.shard_map(lambda v: lax.psum(v, "i"), mesh=mesh, in_specs=P("i"),
                                 out_specs=P("i")))
    x = jax.device_put(jnp.ones(size // 4, jnp.float32), dev)
    glob = jax.device_put(x, NamedSharding(mesh, P("i")))
    jaxpg.all_reduce(x).block_until_ready()
    kernel = next(iter(eager._flat.values()))[0]
    def busy(us: float) -> None:  # host work between calls, as the eager path's Python
        end = time.perf_counter() + us * 1e-6
        while time.perf_counter() < end:
            pass

    fns = {"hand-written, global input": lambda: hand(glob),
           "hand-written after 6 us of Python": lambda: (busy(6), hand(glob))[1],
           "eager kernel called directly": lambda: kernel(x),
           "eager": lambda: jaxpg.all_reduce(x)}
    timed = run_rounds(fns, rounds, iters=100)
    jaxpg.destroy_process_group()
    return {"size_bytes": size, **{k: v * 1e6 for k, v in timed.medians().items()},
            **timed.loads()}


def fr_probe(rounds: int, calls: int = 300) -> dict:
    """The flight recorder's cost per eager call (``--fr-probe``).

    A world of one process started as a multi-process one (``tcp://``, world size 1): every
    eager ``all_reduce`` goes through ``run_collective`` and is numbered and recorded, in
    place (no peer: no runner hop), so little else varies. Rounds of ``calls`` blocking
    1 KiB all_reduces alternate the recorder on (``JAXPG_FR_BUFFER_SIZE=2000``: the caller's
    frame looked up, the ring appended) and off (each group's last call only), in the same
    process; the cost is the median over round pairs of on minus off. The record every call
    makes even with the recorder off is timed alone (``record_us``): ``recorder.start`` and
    ``complete`` in a loop, against the empty loop.
    """
    import jax
    import numpy as np

    import jaxpg
    from jaxpg.supervision.flight_recorder import recorder

    jaxpg.init_process_group(init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1,
                             rank=0)
    x = jax.device_put(np.ones(256, np.float32), jax.devices()[0])
    for _ in range(50):
        jaxpg.all_reduce(x).block_until_ready()
    call = lambda: jaxpg.all_reduce(x)  # noqa: E731
    timed = run_rounds({"off": call, "on": call}, rounds, iters=calls,
                       setup=lambda mode: recorder.configure(2000 if mode == "on" else 0))
    per = {k: [t * 1e6 for t in v] for k, v in timed.wall.items()}
    diffs = [a - b for a, b in zip(per["on"], per["off"])]
    group = jaxpg.GroupMember.WORLD
    parts = _recorder_parts(group)
    jaxpg.destroy_process_group()
    return {"calls_per_round": calls, "rounds": rounds,
            "eager_us": {k: statistics.median(v) for k, v in per.items()},
            "eager_best_round_us": {k: min(v) for k, v in per.items()},
            "recorder_on_minus_off_us": statistics.median(diffs),
            "recorder_on_minus_off_best_rounds_us": min(per["on"]) - min(per["off"]),
            "recorder_on_minus_off_p90_us": sorted(diffs)[int(0.9 * len(diffs))],
            **parts, **timed.loads()}


def _recorder_parts(group) -> dict:
    """The recorder's own work per call, each part timed alone (the best of 15 repeats of
    20000, which load disturbs least): a record with the ring off (made by every call) and
    on, and a public collective's caller lookup (``call_pinned``) against a plain call."""
    import timeit

    from jaxpg.supervision import flight_recorder as fr

    fp = ("all_reduce", None, (("x", (256,), "float32"),))
    rec = fr._Recorder()

    def best(fn) -> float:
        return min(timeit.repeat(fn, number=20000, repeat=15)) / 20000 * 1e6

    rec.configure(0)
    off = best(lambda: rec.start(group, 1, "all_reduce", "collective", fp, None).complete())
    rec.configure(2000)
    on = best(lambda: rec.start(group, 1, "all_reduce", "collective", fp, None).complete())
    namespace = {"call_pinned": fr.call_pinned, "capture": fr.capture_caller}
    exec(compile("def api():\n    return capture()\n"
                 "def pinned():\n    return call_pinned(api, (), {})\n"
                 "def plain():\n    return None\n", fr._PACKAGE + "_probe.py", "exec"),
         namespace)
    lookup = best(namespace["pinned"]) - best(namespace["plain"])
    return {"record_off_us": off, "record_on_us": on, "caller_lookup_us": lookup,
            "recorder_parts_on_minus_off_us": on - off + lookup}


def runner_hop(reps: int = 3000) -> dict:
    """The blocking path's thread hop alone: a no-op queued on the runner and waited for,
    against the same no-op called directly, interleaved; medians in µs."""
    from jaxpg.groups import multiprocess

    def noop() -> None:
        return None

    timed = run_rounds({"hop": lambda: multiprocess.submit(noop, "noop").result(10.0),
                        "direct": noop}, reps)
    med = timed.medians()
    return {"hop_us": med["hop"] * 1e6, "direct_us": med["direct"] * 1e6,
            "hop_p90_us": sorted(timed.wall["hop"])[int(0.9 * reps)] * 1e6}


def _jax_version() -> str:
    import jax

    return jax.__version__


ONE_DEVICE = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}


def run_layout(layout: str, args: argparse.Namespace, out: Path) -> dict:
    env = {**ONE_DEVICE, "JAXPG_DEBUG": "DETAIL" if layout == "mp2_detail" else None,
           "TORCH_DISTRIBUTED_DEBUG": None}
    done = launch(__file__, ["--worker", "--layout", layout, "--sizes", args.sizes, "--ops",
                             args.ops, "--rounds", args.rounds, "--out", out],
                  nproc=2 if layout.startswith("mp2") else None, env=env,
                  timeout=args.timeout, what=layout)
    print((done.output or "").strip(), flush=True)
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", default="single")
    p.add_argument("--layouts", default="single,tcp1,mp2,mp2_detail")
    p.add_argument("--sizes", default="1K,1M,16M")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=str(RESULTS / "collectives_overhead.json"))
    p.add_argument("--fr-probe", action="store_true",
                   help="only the flight recorder's cost per eager call; adds it to --out")
    p.add_argument("--spin-probe", default=None, metavar="SIZE",
                   help="only the one-device probe at SIZE (e.g. 64K); adds it to --out")
    add_flag(p)
    args = p.parse_args()
    if args.worker and args.layout == "fr_probe":
        Path(args.out).write_text(json.dumps(fr_probe(args.rounds)))
        return
    if args.worker:
        worker(args)
        return
    if args.fr_probe:
        tmp = Path(args.out).with_suffix(".part.json")
        unset = {k: None for k in os.environ if k.startswith(("JAXPG_", "TORCH_"))}
        launch(__file__, ["--worker", "--layout", "fr_probe", "--rounds", args.rounds,
                          "--out", tmp], env={**unset, **ONE_DEVICE}, timeout=args.timeout,
               capture=False)
        probe = json.loads(tmp.read_text())
        tmp.unlink()
        probe.update(command="python bench/collectives_overhead.py --fr-probe "
                             f"--rounds {args.rounds}",
                     load_average=load_average(), jax_version=_jax_version())
        print(json.dumps(probe, indent=1))
        out = Path(args.out)
        data = json.loads(out.read_text()) if out.exists() else {}
        data["flight_recorder"] = probe
        out.write_text(json.dumps(data, indent=1))
        return
    if args.spin_probe:
        probe = spin_probe(parse_size(args.spin_probe))
        print(probe)
        out = Path(args.out)
        data = json.loads(out.read_text()) if out.exists() else {}
        data["spin_probe"] = probe
        out.write_text(json.dumps(data, indent=1))
        return
    if args.quick:
        args.sizes, args.rounds = "1K,1M", 5
    results = {"command": " ".join(["python", "bench/collectives_overhead.py", *sys.argv[1:]]),
               "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, shared with "
                          "other jobs", "layouts": {}}
    tmp = Path(args.out).with_suffix(".part.json")
    for layout in args.layouts.split(","):
        results["layouts"][layout] = run_layout(layout, args, tmp)
    results["runner_hop"] = runner_hop()
    print(f"runner thread hop: {results['runner_hop']}")
    tmp.unlink(missing_ok=True)
    save(args.out, results, args.configuration)
    print("\n| layout | op | size | hand-written µs | eager µs | overhead µs | check µs |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for layout, res in results["layouts"].items():
        for r in res["rows"]:
            check = f"{r['check_us']:+.1f}" if "check_us" in r else ""
            print(f"| {layout} | {r['op']} | {fmt_size(r['size_bytes'])} | "
                  f"{r['median_us']['hand']:.1f} | {r['median_us']['eager']:.1f} | "
                  f"{r['overhead_us']:+.1f} | {check} |")


if __name__ == "__main__":
    main()
