"""backend="mpi" against gloo and torch: all_reduce bus bandwidth and a DDP step under mpirun.

For N = 2 and 4 processes on this machine, ``mpirun`` (Open MPI) starts
``bench/_cluster_worker.py``, whose processes join jaxpg's world from mpirun's variables
alone (``init_process_group(backend=B)``) and a torch gloo world of the same ranks. One
launch per jaxpg backend B (``mpi``: XLA's MPI collectives through MPIwrapper; ``gloo``:
XLA's gloo), alternating, ``--launches`` times each. Inside a launch, round by round in a
rotating order and after a torch barrier, it times jaxpg's eager ``all_reduce``, XLA's
jitted psum alone and torch gloo's in-place ``all_reduce`` at 1, 16 and 64 MB per rank, and
a DDP step of the 25M-parameter MLP in jaxpg and in torch (the slowest rank's time per
round; the median over rounds). So each backend's ratio to torch gloo is measured side by
side in the same processes; MPI against jaxpg's gloo is the ratio of those ratios.

``busbw = S x 2(N-1)/N / time`` (nccl-tests). Bound to a core each at N <= the CPU count,
unbound beyond (N = 4 runs 4 processes on 2 cores here); torch uses as many threads as the
process has CPUs, as XLA's thread pool does. The workers get jaxpg-run's
``GLIBC_TUNABLES`` for CPU workers (unless set), so that XLA's fresh output buffers are
not fresh ``mmap``s with page faults on every call (docs/design.md).

Also (``--dispatch``): what turning off JAX's asynchronous CPU dispatch costs in one
process (backend="mpi" must): a chain of small jitted additions, and the MLP's local
training step, alternately with dispatch on and off.

Needs mpirun and MPIwrapper (``.ci/install_cluster_deps.sh``; ``MPITRAMPOLINE_LIB`` or
the cache it builds into) and torch. Run under the benchmark lock::

    flock /tmp/jaxpg-bench.lock python bench/cluster.py        # ~10 minutes here
    flock /tmp/jaxpg-bench.lock python bench/cluster.py --quick

Writes ``bench/results/cluster.json`` (``--configuration NAME``: as that named
configuration inside it) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _launch import BENCH, RESULTS, LaunchError, child_env, free_port, launch
from _results import add_flag, save
from _rounds import load_average as _load
from _rounds import medians

from jaxpg.run.env import _GLIBC_TUNABLES as GLIBC_TUNABLES

WORKER = BENCH / "_cluster_worker.py"
OUT = RESULTS / "cluster.json"
_DEFAULT_LIB = Path.home() / ".cache" / "jaxpg" / "MPIwrapper-2.11.1" / "inst" / "lib" / \
    "libmpiwrapper.so"


def _env(lib: str) -> dict[str, str | None]:
    # what jaxpg-run gives its CPU workers: big buffers stay in the heap (docs/cluster.md)
    return {"XLA_FLAGS": None, "PYTHONUNBUFFERED": "1", "MPITRAMPOLINE_LIB": lib,
            "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", GLIBC_TUNABLES)}


def _launch(n: int, backend: str, args: argparse.Namespace, lib: str) -> dict:
    # mpirun, not bench/_launch.launch: the workers join from mpirun's variables (the point
    # of this benchmark); they get launch's environment (child_env) all the same
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        bind = "core" if n <= (os.cpu_count() or 1) else "none"
        cmd = ["mpirun", "-n", str(n), "--oversubscribe", "--bind-to", bind]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        for name in ("JAX_PLATFORMS", "PYTHONUNBUFFERED", "MPITRAMPOLINE_LIB", "PYTHONPATH",
                     "GLIBC_TUNABLES"):
            cmd += ["-x", name]
        cmd += [sys.executable, str(WORKER), "--backend", backend, "--torch-port",
                str(free_port()), "--rounds", str(args.rounds), "--ddp-rounds",
                str(args.ddp_rounds), "--out", str(out), "--sizes-mb",
                *[str(s) for s in args.sizes_mb]]
        before = _load()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                              env=child_env(_env(lib)))
        if proc.returncode != 0:
            raise LaunchError(f"{' '.join(cmd)} failed (exit code {proc.returncode}):\n"
                              f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        result = json.loads(out.read_text())
        result["load_before"], result["load_after"] = before, _load()
        return result


def _dispatch(args: argparse.Namespace, lib: str) -> list[dict]:
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.dispatch_repeats):
            for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
                out = Path(tmp) / f"{mode}{i}.json"
                launch(WORKER, ["--dispatch-probe", mode, "--out", out], env=_env(lib),
                       timeout=600, expect=[out])
                runs.append(json.loads(out.read_text()) | {"load": _load()})
    return runs


def _busbw(mb: float, n: int, seconds: float) -> float:
    return mb * 2**20 * 2 * (n - 1) / n / seconds / 1e9


def summarize(launches: list[dict]) -> dict:
    """Medians per (N, backend): times, busbw, and the ratios to torch of each launch."""
    out: dict = {}
    for r in launches:
        n, b = r["world_size"], r["backend"]
        entry = out.setdefault(str(n), {}).setdefault(b, {"sizes": {}, "ddp": {}})
        for mb, times in r["sizes"].items():
            med = medians(times)
            cell = entry["sizes"].setdefault(mb, {"busbw_GBps": {}, "ratio_to_torch": []})
            for v, t in med.items():
                cell["busbw_GBps"].setdefault(v, []).append(_busbw(float(mb), n, t))
            cell["ratio_to_torch"].append(med["torch"] / med["jaxpg"])  # busbw ratio
        med = medians(r["ddp"])
        entry["ddp"].setdefault("step_ms", {})
        for v, t in med.items():
            entry["ddp"]["step_ms"].setdefault(v, []).append(t * 1e3)
        entry["ddp"].setdefault("speed_ratio_to_torch", []).append(
            med["torch_ddp"] / med["jaxpg_ddp"])
    return out


def _table(summary: dict) -> str:
    rows = ["| N | size | jaxpg+MPI | jaxpg+gloo | torch gloo (in MPI launches) | "
            "MPI / torch | jaxpg gloo / torch | MPI / jaxpg gloo |", "|---|---|---:|---:|---:|"
            "---:|---:|---:|"]
    med = statistics.median
    for n, by in summary.items():
        for mb in by["mpi"]["sizes"]:
            m, g = by["mpi"]["sizes"][mb], by["gloo"]["sizes"][mb]
            rm, rg = med(m["ratio_to_torch"]), med(g["ratio_to_torch"])
            rows.append(
                f"| {n} | {float(mb):g} MB | {med(m['busbw_GBps']['jaxpg']):.2f} GB/s | "
                f"{med(g['busbw_GBps']['jaxpg']):.2f} GB/s | "
                f"{med(m['busbw_GBps']['torch']):.2f} GB/s | {rm:.2f}x | {rg:.2f}x | "
                f"{rm / rg:.2f}x |")
    rows += ["", "| N | jaxpg DDP + MPI | jaxpg DDP + gloo | torch DDP (in MPI launches) | "
             "MPI / torch | jaxpg gloo / torch |", "|---|---:|---:|---:|---:|---:|"]
    for n, by in summary.items():
        m, g = by["mpi"]["ddp"], by["gloo"]["ddp"]
        rows.append(f"| {n} | {med(m['step_ms']['jaxpg_ddp']):.0f} ms | "
                    f"{med(g['step_ms']['jaxpg_ddp']):.0f} ms | "
                    f"{med(m['step_ms']['torch_ddp']):.0f} ms | "
                    f"{med(m['speed_ratio_to_torch']):.2f}x | "
                    f"{med(g['speed_ratio_to_torch']):.2f}x |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64])
    p.add_argument("--launches", type=int, default=2, help="launches per backend and N")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--ddp-rounds", type=int, default=5)
    p.add_argument("--dispatch-repeats", type=int, default=2)
    p.add_argument("--no-dispatch", action="store_true")
    p.add_argument("--quick", action="store_true", help="1 launch each, 3 rounds")
    p.add_argument("--out", default=str(OUT))
    add_flag(p)
    args = p.parse_args()
    if args.quick:
        args.launches, args.rounds, args.ddp_rounds, args.dispatch_repeats = 1, 3, 3, 1
    lib = os.environ.get("MPITRAMPOLINE_LIB") or str(_DEFAULT_LIB)
    if not Path(lib).is_file() or shutil.which("mpirun") is None:
        sys.exit(f"needs mpirun and MPIwrapper ({lib} is missing): run "
                 ".ci/install_cluster_deps.sh, or set MPITRAMPOLINE_LIB")
    launches = []
    for n in args.nprocs:
        for i in range(args.launches):
            for backend in (("mpi", "gloo") if i % 2 == 0 else ("gloo", "mpi")):
                print(f"N={n} launch {i} backend={backend} load={_load()}", flush=True)
                launches.append(_launch(n, backend, args, lib))
    summary = summarize(launches)
    dispatch = [] if args.no_dispatch else _dispatch(args, lib)
    import jax
    import torch

    mpirun = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "jax": jax.__version__,
                    "torch": torch.__version__, "mpirun": mpirun.splitlines()[0],
                    "mpitrampoline_lib": lib},
        "settings": vars(args), "summary": summary, "dispatch": dispatch,
        "launches": launches,
    }
    save(args.out, result, args.configuration)
    print(_table(summary))
    if dispatch:
        for mode in ("on", "off"):
            rows = [d for d in dispatch if d["async_dispatch"] == mode]
            print(f"async dispatch {mode}: small op "
                  f"{statistics.median(d['small_op_us'] for d in rows):.1f} us, MLP local step "
                  f"{statistics.median(d['mlp_local_step_ms'] for d in rows):.0f} ms")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
