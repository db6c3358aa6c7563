"""``jaxpg-run``: a torchrun-style launcher for JAX programs.

It starts ``--nproc-per-node`` copies of a script on this machine, gives each the
environment that ``init_process_group("env://")`` reads, and watches them::

    jaxpg-run --nproc-per-node 4 train.py --lr 0.1
    python -m jaxpg.run --nproc-per-node 2 --devices-per-proc 2 -m mypkg.train

Each worker gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK`` (the node rank), ``MASTER_ADDR``, ``MASTER_PORT`` (where process 0
hosts JAX's coordination service), ``PYTHONUNBUFFERED=1`` and its devices: on CPU,
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` with ``N`` from
``--devices-per-proc`` (default 1, or ``JAXPG_DEVICES_PER_PROC``); with NVIDIA GPUs,
``CUDA_VISIBLE_DEVICES`` set to the worker's own ``N`` GPUs.

Every line a worker prints comes out prefixed with ``[rank N]``. When a worker
exits with a non-zero code, the launcher stops the others (SIGTERM, then SIGKILL
after ``--grace-period`` seconds) and exits with that code; on Ctrl-C it stops
them all and exits 130 (143 on SIGTERM). Workers die with the launcher (Linux).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

__all__ = ["main", "worker_env"]

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def _positive_int(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be at least 1, got {value}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxpg-run",
        description="Start several JAX processes on this machine, like torchrun.",
    )
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=_positive_int("--nproc-per-node"),
        default=1,
        help="worker processes on this node (default 1)",
    )
    p.add_argument(
        "--nnodes", type=_positive_int("--nnodes"), default=1, help="number of nodes (default 1)"
    )
    p.add_argument(
        "--node-rank",
        "--node_rank",
        type=int,
        default=0,
        help="this node's index in [0, nnodes) (default 0)",
    )
    p.add_argument(
        "--master-addr",
        "--master_addr",
        default="127.0.0.1",
        help="address of the node that runs rank 0 (default 127.0.0.1)",
    )
    p.add_argument(
        "--master-port",
        "--master_port",
        type=int,
        default=None,
        help="coordinator port (default: a free port; required with --nnodes > 1)",
    )
    p.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default=None,
        help="host:port of the coordinator; overrides --master-addr/--master-port",
    )
    p.add_argument(
        "--standalone",
        action="store_true",
        help="one node, a free local port (as torchrun --standalone)",
    )
    p.add_argument(
        "--devices-per-proc",
        "--devices_per_proc",
        type=_positive_int("--devices-per-proc"),
        default=None,
        help="devices per worker (default $JAXPG_DEVICES_PER_PROC or 1)",
    )
    p.add_argument(
        "--grace-period",
        type=float,
        default=5.0,
        help="seconds between SIGTERM and SIGKILL when stopping workers (default 5)",
    )
    p.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="run the script argument as a module, like python -m",
    )
    p.add_argument(
        "--no-python",
        "--no_python",
        action="store_true",
        help="run the script argument as an executable, not with python",
    )
    p.add_argument("training_script", help="the script (or module with -m) to run")
    p.add_argument(
        "training_script_args", nargs=argparse.REMAINDER, help="arguments passed on to the script"
    )
    return p


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.standalone:
        if args.nnodes != 1:
            parser.error(f"--standalone runs one node, but --nnodes is {args.nnodes}")
        args.master_addr, args.master_port = "127.0.0.1", None
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank must be in [0, --nnodes={args.nnodes}), got {args.node_rank}")
    if args.rdzv_endpoint is not None:
        host, sep, port = args.rdzv_endpoint.rpartition(":")
        if not sep or not host or not port.isdigit():
            parser.error(f"--rdzv-endpoint must be host:port, got {args.rdzv_endpoint!r}")
        args.master_addr, args.master_port = host, int(port)
    if args.master_port is not None and not 0 < args.master_port < 65536:
        parser.error(f"--master-port must be in [1, 65535], got {args.master_port}")
    if args.master_port is None and args.nnodes > 1:
        parser.error(
            f"--nnodes {args.nnodes} needs --master-port (or --rdzv-endpoint) so that all "
            "nodes agree on the coordinator's port"
        )
    if args.module and args.no_python:
        parser.error("-m/--module and --no-python cannot be used together")
    if args.devices_per_proc is None:
        raw = os.environ.get("JAXPG_DEVICES_PER_PROC", "1")
        try:
            args.devices_per_proc = _positive_int("JAXPG_DEVICES_PER_PROC")(raw)
        except argparse.ArgumentTypeError as err:
            parser.error(str(err))
    gpus = _visible_gpus()
    needed = args.nproc_per_node * args.devices_per_proc
    if gpus and needed > len(gpus):
        parser.error(
            f"--nproc-per-node {args.nproc_per_node} x --devices-per-proc "
            f"{args.devices_per_proc} needs {needed} GPUs, but {len(gpus)} are visible"
        )
    return args


def _visible_gpus() -> list[str]:
    """The NVIDIA GPUs this launcher may hand out (honours CUDA_VISIBLE_DEVICES)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    try:
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []


_GLIBC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"


def worker_env(
    base: dict[str, str],
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
    devices_per_proc: int = 1,
    gpus: Sequence[str] = (),
) -> dict[str, str]:
    """The environment of one worker: ``base`` plus the launcher's variables.

    Args:
        base: the launcher's environment.
        rank: the worker's global rank.
        local_rank: the worker's index on this node.
        world_size: the number of workers in the job.
        local_world_size: the number of workers on this node.
        node_rank: this node's index.
        master_addr: the coordinator's host.
        master_port: the coordinator's port.
        devices_per_proc: how many devices each worker gets.
        gpus: the GPU ids to share out; empty on a machine without GPUs.
    """
    env = dict(base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(local_world_size),
        GROUP_RANK=str(node_rank),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        JAXPG_DEVICES_PER_PROC=str(devices_per_proc),
        PYTHONUNBUFFERED="1",
    )
    flags = _DEVICE_COUNT_FLAG.sub("", env.get("XLA_FLAGS", "")).split()
    flags.append(f"--xla_force_host_platform_device_count={devices_per_proc}")
    env["XLA_FLAGS"] = " ".join(flags)
    if "JAX_NUM_CPU_DEVICES" in env:
        env["JAX_NUM_CPU_DEVICES"] = str(devices_per_proc)
    if gpus:
        start = local_rank * devices_per_proc
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[start : start + devices_per_proc])
    else:
        # XLA's CPU collectives allocate a fresh output buffer per call; with glibc's default
        # thresholds every large one is a new mmap and pays its page faults again (64 MB:
        # ~35 ms). Keeping big blocks in the heap made 16 MB reduce_scatter 2-3x faster
        # (bench/results/collectives_mp.json, allocator_experiment). The user's setting wins.
        env.setdefault("GLIBC_TUNABLES", _GLIBC_TUNABLES)
    return env


def _command(args: argparse.Namespace) -> list[str]:
    if args.no_python:
        return [args.training_script, *args.training_script_args]
    if args.module:
        return [sys.executable, "-u", "-m", args.training_script, *args.training_script_args]
    return [sys.executable, "-u", args.training_script, *args.training_script_args]


def _die_with_parent() -> None:
    """In the child, before exec: get SIGKILL when the launcher dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _pump(pipe: IO[bytes], out: IO[bytes], prefix: bytes, lock: threading.Lock) -> None:
    """Copies ``pipe`` to ``out`` line by line, each line prefixed."""
    for line in iter(pipe.readline, b""):
        with lock:
            out.write(prefix + (line if line.endswith(b"\n") else line + b"\n"))
            out.flush()
    pipe.close()


class _Terminated(Exception):
    """Raised in the main thread when the launcher gets SIGTERM."""


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM every live worker's process group, then SIGKILL after ``grace`` s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.02)
    for p in procs:
        p.wait()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _say(message: str) -> None:
    sys.stderr.write(f"[jaxpg-run] {message}\n")
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the launcher; returns its exit code (see the module docstring)."""
    args = _parse(argv)
    if args.master_port is None:
        from jaxpg.rendezvous import free_port

        args.master_port = free_port(args.master_addr)
    nproc, gpus = args.nproc_per_node, _visible_gpus()
    world_size = args.nnodes * nproc
    command = _command(args)
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []

    def on_sigterm(signum: int, frame: object) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    threads: list[threading.Thread] = []
    try:
        for local_rank in range(nproc):
            rank = args.node_rank * nproc + local_rank
            env = worker_env(
                dict(os.environ),
                rank=rank,
                local_rank=local_rank,
                world_size=world_size,
                local_world_size=nproc,
                node_rank=args.node_rank,
                master_addr=args.master_addr,
                master_port=args.master_port,
                devices_per_proc=args.devices_per_proc,
                gpus=gpus,
            )
            procs.append(
                subprocess.Popen(
                    command,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    process_group=0,
                    preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                )
            )
        for local_rank, p in enumerate(procs):
            prefix = f"[rank {args.node_rank * nproc + local_rank}] ".encode()
            for pipe, out in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer)):
                t = threading.Thread(target=_pump, args=(pipe, out, prefix, lock), daemon=True)
                t.start()
                threads.append(t)
        code = _watch(procs, args)
    except KeyboardInterrupt:
        _say("interrupted; stopping all workers")
        _stop(procs, args.grace_period)
        code = 130
    except _Terminated:
        _say("got SIGTERM; stopping all workers")
        _stop(procs, args.grace_period)
        code = 143
    except OSError as err:
        _say(f"could not start {command[0]!r}: {err}")
        _stop(procs, args.grace_period)
        code = 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    for t in threads:
        t.join(timeout=2.0)
    return code


def _watch(procs: list[subprocess.Popen], args: argparse.Namespace) -> int:
    """Waits for the workers; on the first failure stops the rest and returns its code."""
    while True:
        running = False
        for local_rank, p in enumerate(procs):
            rc = p.poll()
            if rc is None:
                running = True
            elif rc != 0:
                rank = args.node_rank * args.nproc_per_node + local_rank
                _say(f"rank {rank} exited with code {rc}; stopping the other workers")
                _stop(procs, args.grace_period)
                return _exit_code(rc)
        if not running:
            return 0
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
