"""The launcher's main loop: start the group, watch it, restart it or stop it."""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxpg.run.cli import parse_args
from jaxpg.run.coordination import LocalNodes, NodeChannel, PortInUseError, WorkerCoordinator
from jaxpg.run.env import visible_gpus, worker_env
from jaxpg.run.error_file import ENV_VAR as ERROR_FILE_VAR
from jaxpg.run.port_owner import listens
from jaxpg.run.summary import RootCause, describe
from jaxpg.run.workers import WorkerGroup
from jaxpg.runtime.hosted_coordinator import PREEMPTION_VAR
from jaxpg.runtime.service_client import LOBBY_VAR, show_cpp_logs

__all__ = ["main"]

_POLL_S = 0.05
_REMOTE_POLL_S = 0.5
_PORT_WATCH_S = 60.0  # how long rank 0's port is checked every remote poll
_PORT_POLL_LATE_S = 5.0  # and how often after that


class _Terminated(Exception):
    """Raised in the main thread when the launcher gets SIGTERM."""


def _say(message: str) -> None:
    sys.stderr.write(f"[jaxpg-run] {message}\n")
    sys.stderr.flush()


_WORKER_SITE = str(Path(__file__).with_name("worker_site"))


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _own_service_message(port: int) -> str:
    return (f"rank 0 started a JAX coordination service of its own on port {port}, where "
            "jaxpg-run already hosts the workers' (the script calls "
            "jax.distributed.initialize itself): the processes split between the two and "
            "wait in initialize for ever; run jaxpg-run with --coordinator rank0, or call "
            "jaxpg.init_process_group() instead of jax.distributed.initialize()")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _command(args: argparse.Namespace) -> list[str]:
    if args.no_python:
        return [args.training_script, *args.training_script_args]
    if args.module:
        return [sys.executable, "-u", "-m", args.training_script, *args.training_script_args]
    return [sys.executable, "-u", args.training_script, *args.training_script_args]


def _start(args: argparse.Namespace, attempt: int, port: int, run_id: str,
           lobby: str, node_rank: int | None = None, nnodes: int | None = None,
           master_addr: str | None = None) -> WorkerGroup:
    """Starts this node's workers; ``node_rank``/``nnodes``/``master_addr`` override the
    flags' (an elastic attempt's group rank, node count and coordinator host)."""
    nproc, gpus = args.nproc_per_node, visible_gpus()
    master_addr = args.master_addr if master_addr is None else master_addr
    node_rank = args.node_rank if node_rank is None else node_rank
    nnodes = args.nnodes if nnodes is None else nnodes
    first = node_rank * nproc
    base = {**os.environ, LOBBY_VAR: lobby}
    envs = [
        worker_env(
            dict(base), rank=first + local_rank, local_rank=local_rank,
            world_size=nnodes * nproc, local_world_size=nproc, node_rank=node_rank,
            master_addr=master_addr, master_port=port,
            devices_per_proc=args.devices_per_proc, gpus=gpus, nnodes=nnodes,
            restart_count=attempt, max_restarts=args.max_restarts, run_id=run_id,
            coordinator_hosted=args.coordinator == "launcher",
        )  # fmt: skip
        for local_rank in range(nproc)
    ]
    log_dir = None if args.log_dir is None else Path(args.log_dir) / run_id / f"attempt_{attempt}"
    for local_rank, env in enumerate(envs):
        errors = Path(lobby) / "errors" if log_dir is None else log_dir / str(local_rank)
        env[ERROR_FILE_VAR] = str(errors / (f"{local_rank}.json" if log_dir is None
                                            else "error.json"))
        env["JAXPG_RUN_LAUNCHER_PID"] = str(os.getpid())
        # JAX's preemption notifier swallows SIGTERM (a script's own
        # jax.distributed.initialize starts it); the user's setting wins
        env.setdefault(PREEMPTION_VAR, "false")
        env["PYTHONPATH"] = os.pathsep.join([_WORKER_SITE, *filter(None, [
            env.get("PYTHONPATH")])])
    return WorkerGroup(
        _command(args), envs, first_rank=first, console_ranks=args.console_ranks,
        tee_masks=args.tee_masks, redirect_masks=args.redirect_masks, log_dir=log_dir,
    )  # fmt: skip


def _describe_rank(group: WorkerGroup, rank: int, rc: int) -> str:
    local = rank - group.first_rank
    return describe(rank, rc, group.error(rank), stuck=local in group.stuck)


def _watch(group: WorkerGroup, nodes, attempt: int, lobby: str,
           own_service_port: int | None = None) -> tuple[str | None, int, list[int]]:
    """Waits until this attempt ends: ``(None, 0, [])`` on success, else the failure, the
    exit code and the ranks that failed here. ``own_service_port``: the port of the
    launcher's coordination service, which rank 0 (here) must not listen on."""
    reported = False
    next_remote = next_port = 0.0
    started = time.monotonic()
    while True:
        failed = group.failed()
        if failed:
            group.filter.quiet = True  # the job comes down: drop C++ log lines from here on
            rank, rc = failed[0]
            message = _describe_rank(group, rank, rc)
            if len(failed) > 1:
                message += " (also failed: " + ", ".join(
                    f"rank {r} with code {c}" for r, c in failed[1:]) + ")"
            nodes.report_failure(attempt, message)
            return message, _exit_code(rc), [r for r, _ in failed]
        if not reported and group.all_succeeded():
            nodes.report_success(attempt)
            reported = True
        now = time.monotonic()
        if own_service_port is not None and now >= next_port:
            # a script starts its service while it sets up: checked every poll at first,
            # then seldom (each check parses the host's TCP table, large on a busy host)
            next_port = now + (_REMOTE_POLL_S if now - started < _PORT_WATCH_S
                               else _PORT_POLL_LATE_S)
            if listens(group.pid(0), own_service_port):
                group.filter.quiet = True
                message = _own_service_message(own_service_port)
                nodes.report_failure(attempt, message)
                return message, 1, []
        if now >= next_remote:
            next_remote = now + _REMOTE_POLL_S
            nodes.share_lobby(attempt, lobby)
            if (remote := nodes.failure(attempt)) is not None:
                group.filter.quiet = True
                return f"{remote} (on another node)", 1, []
            if reported and nodes.all_succeeded(attempt):
                return None, 0, []
        time.sleep(_POLL_S)


def _quiet_services() -> None:
    """Keeps the C++ log lines of the coordination services this launcher hosts off its
    console, unless ``JAXPG_DEBUG`` is set: the launcher's Python output (its messages,
    the workers' stderr, a traceback) moves to a copy of stderr, and file descriptor 2,
    where only C++ code still writes, goes through a thread that drops everything up to a
    fatal line (``F....``, ``terminate called``, ``Fatal Python error``), which it passes on
    with what follows."""
    if show_cpp_logs() or getattr(sys.stderr, "_jaxpg_launcher", False):
        return
    try:
        sys.stderr.flush()
        real = os.dup(2)
    except (AttributeError, OSError, ValueError):
        return
    stream = io.TextIOWrapper(open(real, "wb", closefd=False),  # noqa: SIM115
                              write_through=True, line_buffering=True,
                              errors="backslashreplace")
    stream._jaxpg_launcher = True  # type: ignore[attr-defined]
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    sys.stderr = stream

    def drain() -> None:
        passing = False
        while chunk := os.read(read_end, 65536):
            if not passing:
                found = re.search(rb"^F\d{4} |terminate called|Fatal Python error", chunk,
                                  re.M)
                if found is None:
                    continue
                passing, chunk = True, chunk[found.start():]
            os.write(real, chunk)

    threading.Thread(target=drain, daemon=True).start()


def run_attempt(args: argparse.Namespace, nodes: Any, attempt: int, port: int,
                **where: Any) -> tuple[str | None, int]:
    """Starts this node's workers of ``attempt``, watches them until they end, a worker fails
    or a node is lost, and stops them (on an exception too); names the failed ranks'
    diagnoses.

    Args:
        args: the parsed flags.
        nodes: the launchers' channel (fixed, local or elastic).
        attempt: the attempt's number.
        port: the workers' coordination port.
        **where: ``_start``'s node_rank, nnodes and master_addr for an elastic attempt.

    Returns:
        ``(failure, exit code)``; failure is None when every worker ended with 0.
    """
    lobby = tempfile.mkdtemp(prefix="jaxpg-lobby-")
    try:
        group = _start(args, attempt, port, nodes.run_id, lobby, **where)
        own = port if args.coordinator == "launcher" and group.first_rank == 0 else None
        stop_signal = signal.SIGTERM
        try:
            failure, code, failed_ranks = _watch(group, nodes, attempt, lobby, own)
            if failure is not None:
                _say(f"{failure}; stopping the other workers")
        except KeyboardInterrupt:  # Ctrl-C: the workers get SIGINT too, as torchrun's
            stop_signal = signal.SIGINT
            raise
        finally:
            group.stop(args.grace_period, stop_signal)
            group.join_output()
        # A rank that was still ending on its own error when the others were stopped (its
        # exit slowed by load, after a peer had already named it lost) is named too: its
        # own exit code, not a signal's.
        stopped = (128 + signal.SIGTERM, 128 + signal.SIGKILL)
        late = [(r, rc) for r, rc in group.failed()
                if rc > 0 and rc not in stopped and r not in failed_ranks]
        for rank, rc in late:
            _say(f"rank {rank} exited with code {rc} on its own while the others were stopped")
        for rank in (failed_ranks + [r for r, _ in late])[:8]:
            if rank - group.first_rank in group.stuck:
                continue  # its line says how it ended, not its SIGKILL
            if (diagnosis := group.diagnosis(rank)) is not None:
                _say(f"rank {rank}: {diagnosis}")
        if failure is not None:
            args.root_cause = _root_cause(group, failure, failed_ranks, late, args)
    finally:
        shutil.rmtree(lobby, ignore_errors=True)
    return failure, code


def _root_cause(group: WorkerGroup, failure: str, failed_ranks: list[int],
                late: list[tuple[int, int]], args: argparse.Namespace) -> RootCause:
    """The attempt's first failure, read before its lobby (and error files) go."""
    if not failed_ranks:  # another node's, or rank 0's own coordination service
        return RootCause(failure)
    rank = failed_ranks[0]
    local = rank - group.first_rank
    proc = group.procs[local]
    path = group.error_files[local]
    others = [_describe_rank(group, r, group.procs[r - group.first_rank].returncode)
              for r in failed_ranks[1:]] + [describe(r, rc, group.error(r)) for r, rc in late]
    return RootCause(
        failure, rank=rank, local_rank=local, node=group.first_rank // len(group.procs),
        pid=proc.pid, returncode=proc.returncode, error=group.error(rank),
        error_file=path if args.log_dir is not None and path and os.path.exists(path)
        else None, stuck=local in group.stuck, others=others)


def _print_summary(args: argparse.Namespace, code: int) -> None:
    cause = getattr(args, "root_cause", None)
    if code not in (0, 130, 143) and cause is not None:
        for line in cause.lines(args.training_script):
            _say(line)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the launcher; returns its exit code (see :mod:`jaxpg.run`). A failed job's last
    lines name its first failure (:mod:`jaxpg.run.summary`)."""
    args = parse_args(argv)
    args.root_cause = None
    code = _run(args, argv)
    _print_summary(args, code)
    return code


def _run(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    if argv is None:  # the command line (a test calling main(argv) keeps its stderr)
        _quiet_services()
    if args.cluster is not None:
        _say(f"started by {args.cluster.launcher} ({args.cluster.variables}): node "
             f"{args.node_rank} of {args.nnodes}, node 0 at {args.master_addr}:{args.master_port}")

    def on_sigterm(signum: int, frame: object) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    # SIGINT stops the workers even where the launcher inherited it ignored (a background
    # job of a non-interactive shell, as CI's legs are), as torchrun handles it explicitly.
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.min_nodes is not None:  # --nnodes MIN:MAX
        from jaxpg.run.elastic_agent import run_elastic

        try:
            return run_elastic(args, run_attempt=run_attempt, say=_say, free_port=_free_port)
        except _Terminated:
            _say("got SIGTERM; stopping all workers")
            return 143
        finally:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, previous_int)
    coordinator: WorkerCoordinator | None = None
    nodes: LocalNodes | NodeChannel | None = None
    try:
        if args.nnodes > 1:
            nodes = NodeChannel(args.master_addr, args.master_port, args.nnodes, args.node_rank,
                                args.rdzv_id)
        else:
            nodes = LocalNodes(args.rdzv_id)
        nodes.agree({"--nproc-per-node": args.nproc_per_node,
                     "--max-restarts": args.max_restarts})
        for attempt in range(args.max_restarts + 1):
            if args.node_rank == 0:
                fixed = attempt == 0 and args.nnodes == 1 and args.master_port is not None
                port = args.master_port if fixed else _free_port(args.master_addr)
                if args.coordinator == "launcher":
                    coordinator = WorkerCoordinator(port, args.nnodes * args.nproc_per_node)
                nodes.publish_port(attempt, port)
            else:
                port = nodes.port(attempt)
            failure, code = run_attempt(args, nodes, attempt, port)
            nodes.barrier(f"stopped/{attempt}")
            if coordinator is not None:
                coordinator.shutdown()
                coordinator = None
            if failure is None:
                nodes.close()
                return 0
            if attempt < args.max_restarts:
                _say(f"restarting the whole group with a fresh rendezvous (restart {attempt + 1} "
                     f"of --max-restarts {args.max_restarts})")
                continue
            if args.max_restarts:
                _say(f"no restarts left (--max-restarts {args.max_restarts}); giving up")
            nodes.close()
            return code
        raise AssertionError("unreachable")
    except KeyboardInterrupt:
        _say("interrupted; stopping all workers")
        code = 130
    except _Terminated:
        _say("got SIGTERM; stopping all workers")
        code = 143
    except PortInUseError as err:
        _say(str(err))
        code = 1
    except OSError as err:
        _say(f"could not start {_command(args)[0]!r}: {err}")
        code = 1
    except ValueError as err:  # the nodes disagree on a setting
        _say(str(err))
        if nodes is not None:
            nodes.close()
        code = 2
    except RuntimeError as err:  # jaxlib's errors from the launchers' coordination service
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        _say(f"lost the coordination between the launchers: {text}; stopping all workers")
        code = 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    if coordinator is not None:
        coordinator.shutdown()
    return code
