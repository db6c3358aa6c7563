"""``jaxpg-run``'s command line: torchrun's flags, checked before anything starts."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from jaxpg.run.env import visible_gpus

__all__ = ["parse_args"]


def _positive_int(name: str, minimum: int = 1):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be at least {minimum}, got {value}")
        return value

    return parse


def _nnodes(text: str) -> tuple[int | None, int]:
    """``N`` or ``MIN:MAX``: ``(None, N)`` or ``(MIN, MAX)``."""
    lo, sep, hi = text.partition(":")
    if not sep:
        return None, _positive_int("--nnodes")(text)
    low, high = _positive_int("--nnodes MIN")(lo), _positive_int("--nnodes MAX")(hi)
    if low > high:
        raise argparse.ArgumentTypeError(f"--nnodes MIN:MAX needs MIN <= MAX, got {text!r}")
    return low, high


_RDZV_CONF = {"heartbeat": "heartbeat", "last_call_timeout": "last_call",
              "join_timeout": "join_timeout"}


def _rdzv_conf(text: str) -> dict[str, float]:
    """``key=seconds,...`` for the elastic rendezvous (keys of ``_RDZV_CONF``)."""
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in _RDZV_CONF:
            raise argparse.ArgumentTypeError(
                f"--rdzv-conf takes key=seconds with keys {sorted(_RDZV_CONF)}, got {item!r}")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if seconds <= 0:
            raise argparse.ArgumentTypeError(
                f"--rdzv-conf {key} must be a positive number of seconds, got {value!r}")
        out[_RDZV_CONF[key]] = seconds
    return out


def _backend(text: str) -> str:
    if text not in ("c10d", "etcd"):
        raise argparse.ArgumentTypeError(
            f"--rdzv-backend must be c10d (the default: node 0's launcher hosts the "
            f"rendezvous) or etcd (an etcd server at --rdzv-endpoint), got {text!r}")
    return text


def _local_addr(etcd: str) -> str:
    """This machine's address on its route to ``etcd`` (``host:port``)."""
    import socket

    host = etcd.rpartition(":")[0].strip("[]")
    try:
        family = socket.getaddrinfo(host, None)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((host, 9))  # UDP: nothing is sent
            return sock.getsockname()[0]
    except OSError:
        return socket.getfqdn()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxpg-run",
        # A script's own option that is a prefix of a launcher flag (``--n``) is the script's.
        allow_abbrev=False,
        description="Start several JAX processes on this node (one launcher per node), like "
                    "torchrun; restart them together on failure.",
    )
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=_positive_int("--nproc-per-node"),
                   default=1, help="worker processes on this node (default 1)")
    p.add_argument("--nnodes", type=_nnodes, default=None,
                   help="number of nodes, or MIN:MAX for elastic membership (default 1, or "
                        "the tasks of an srun/mpirun that started one launcher per node)")
    p.add_argument("--rdzv-conf", "--rdzv_conf", type=_rdzv_conf, default={},
                   help="elastic rendezvous settings, seconds: heartbeat=10,"
                        "last_call_timeout=2,join_timeout=600")
    p.add_argument("--node-rank", "--node_rank", type=int, default=None,
                   help="this node's index in [0, nnodes) (default: the task's rank under "
                        "srun/mpirun; with --nnodes > 1, the order of joining the rendezvous, "
                        "whose host's launcher serves it; else 0)")
    p.add_argument("--master-addr", "--master_addr", default=None,
                   help="address of node 0, which hosts the coordination (default 127.0.0.1, "
                        "or the first node of the Slurm step / mpirun's host)")
    p.add_argument("--master-port", "--master_port", type=int, default=None,
                   help="port on node 0 (default: a free port; required with --nnodes > 1)")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None,
                   help="host:port of node 0; overrides --master-addr/--master-port")
    p.add_argument("--rdzv-backend", "--rdzv_backend", type=_backend, default="c10d",
                   help="c10d (default: node 0's launcher hosts the rendezvous) or etcd (an "
                        "etcd server at --rdzv-endpoint does: any node may be lost)")
    p.add_argument("--local-addr", "--local_addr", default=None,
                   help="with --rdzv-backend etcd: the address the other nodes reach this "
                        "one at (default: this machine's address on its route to etcd)")
    p.add_argument("--rdzv-id", "--rdzv_id", "--run-id", "--run_id", dest="rdzv_id",
                   default=None,
                   help="the job's id, TORCHELASTIC_RUN_ID (default: node 0 makes one)")
    p.add_argument("--standalone", action="store_true",
                   help="one node, a free local port (as torchrun --standalone)")
    p.add_argument("--devices-per-proc", "--devices_per_proc",
                   type=_positive_int("--devices-per-proc"), default=None,
                   help="devices per worker (default $JAXPG_DEVICES_PER_PROC or 1)")
    p.add_argument("--max-restarts", "--max_restarts", type=_positive_int("--max-restarts", 0),
                   default=0,
                   help="restart the whole group up to N times when a worker fails (default 0)")
    p.add_argument("--coordinator", choices=("launcher", "rank0"), default="launcher",
                   help="who hosts JAX's coordination service: this launcher on node 0 "
                        "(default; survives any worker's death) or the worker of rank 0, as "
                        "jax.distributed.initialize does (for scripts that call it themselves)")
    p.add_argument("--grace-period", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping workers (default 5)")
    p.add_argument("--local-ranks-filter", "--local_ranks_filter", default=None,
                   help="show only these local ranks' output on the console, e.g. 0 or 0,2 "
                        "(log files keep every rank)")
    p.add_argument("--log-dir", "--log_dir", default=None,
                   help="write each worker's output to LOG_DIR/<run id>/attempt_<k>/<local "
                        "rank>/{stdout,stderr}.log")
    p.add_argument("--tee", "-t", default=None,
                   help="with --log-dir: streams copied to the log files and the console: "
                        "1 stdout, 2 stderr, 3 both, or per local rank like 0:3,1:1 "
                        "(default 3 when --log-dir is given)")
    p.add_argument("--redirect", "-r", default=None,
                   help="with --log-dir: streams sent to the log files only (same values)")
    p.add_argument("-m", "--module", action="store_true",
                   help="run the script argument as a module, like python -m")
    p.add_argument("--no-python", "--no_python", action="store_true",
                   help="run the script argument as an executable, not with python")
    p.add_argument("training_script", help="the script (or module with -m) to run")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER,
                   help="arguments passed on to the script")
    return p


def _streams(flag: str, text: str | None, nproc: int) -> list[int]:
    """Parses a --tee/--redirect value into a bit mask per local rank (1 out, 2 err)."""
    if text is None:
        return [0] * nproc
    masks = [0] * nproc
    bad = argparse.ArgumentTypeError(
        f"{flag} must be 0, 1 (stdout), 2 (stderr), 3 (both) or local_rank:value pairs like "
        f"0:3,1:1, got {text!r}"
    )
    if ":" not in text:
        if text not in ("0", "1", "2", "3"):
            raise bad
        return [int(text)] * nproc
    for part in text.split(","):
        rank, _, value = part.partition(":")
        if not rank.isdigit() or value not in ("0", "1", "2", "3"):
            raise bad
        if int(rank) >= nproc:
            raise argparse.ArgumentTypeError(
                f"{flag}={text!r} names local rank {rank}, but --nproc-per-node is {nproc}"
            )
        masks[int(rank)] = int(value)
    return masks


def _ranks_filter(text: str | None, nproc: int) -> set[int]:
    if text is None or text.strip() == "":
        return set(range(nproc))
    try:
        ranks = {int(r) for r in text.replace(" ", ",").split(",") if r}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--local-ranks-filter must be local ranks separated by commas, like 0,2; got {text!r}"
        ) from None
    bad = sorted(r for r in ranks if not 0 <= r < nproc)
    if bad:
        raise argparse.ArgumentTypeError(
            f"--local-ranks-filter={text!r} names local ranks {bad}, but the local ranks are "
            f"0..{nproc - 1} (--nproc-per-node {nproc})"
        )
    return ranks


def _nodes_from_launcher(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Without ``--nnodes``, takes the nodes from the launcher that started one jaxpg-run per
    node (``srun --ntasks-per-node=1 jaxpg-run ...``, or mpirun's): its tasks are the
    nodes, the task's rank is the node rank, and node 0 is the coordinator's host and port
    (see ``jaxpg.rendezvous.cluster_env``), where ``--node-rank``, ``--master-addr`` and
    ``--master-port`` are not given; then torchrun's defaults for the rest."""
    found = None
    if not args.standalone and args.rdzv_endpoint is None:
        from jaxpg.rendezvous.cluster_env import detect_launcher

        try:
            found = detect_launcher()
        except ValueError as err:
            parser.error(str(err))
        if found is not None and (found.launcher == "torchrun" or found.world_size == 1):
            found = None  # started by another launcher's worker, or a single task
    if args.nnodes is not None:
        found = None  # the user lays out the nodes
    args.cluster = found
    if found is not None:
        host, _, port = (found.coordinator or "").rpartition(":")
        args.nnodes = found.world_size
        if args.node_rank is None:
            args.node_rank = found.rank
        if args.master_addr is None and host:
            args.master_addr = host
        if args.master_port is None and port:
            args.master_port = int(port)
    args.nnodes = 1 if args.nnodes is None else args.nnodes
    args.node_rank_given = args.node_rank is not None
    args.node_rank = 0 if args.node_rank is None else args.node_rank
    args.master_addr = "127.0.0.1" if args.master_addr is None else args.master_addr


def _check_etcd(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``--rdzv-backend etcd``: an etcd answers at ``--rdzv-endpoint``."""
    from jaxpg.run.rdzv_etcd import probe_etcd

    try:
        probe_etcd(args.rdzv_endpoint)
    except ConnectionError as err:
        parser.error(f"--rdzv-endpoint {args.rdzv_endpoint} (--rdzv-backend etcd): {err}; "
                     "start etcd there (its --listen-client-urls) or pass the client address "
                     "of a running one")
    if args.local_addr is None:
        args.local_addr = _local_addr(args.rdzv_endpoint)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parses and checks ``argv``; exits with status 2 and a message naming the flag."""
    parser = _parser()
    args = parser.parse_args(argv)
    args.min_nodes, args.nnodes = (None, None) if args.nnodes is None else args.nnodes
    _nodes_from_launcher(args, parser)
    if args.standalone:
        if args.nnodes != 1:
            parser.error(f"--standalone runs one node, but --nnodes is {args.nnodes}")
        args.master_addr, args.master_port = "127.0.0.1", None
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank must be in [0, --nnodes={args.nnodes}), got {args.node_rank}")
    if args.rdzv_backend == "etcd" and args.rdzv_endpoint is None:
        parser.error("--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT, the client address "
                     "of an etcd server (etcd --listen-client-urls http://HOST:PORT ...)")
    if args.rdzv_endpoint is not None:
        host, sep, port = args.rdzv_endpoint.rpartition(":")
        if not sep or not host or not port.isdigit():
            parser.error(f"--rdzv-endpoint must be host:port, got {args.rdzv_endpoint!r}")
        args.master_addr, args.master_port = host, int(port)
    if args.rdzv_backend == "etcd":
        if args.rdzv_id is None:
            parser.error("--rdzv-backend etcd needs --rdzv-id ID, the same on every node and "
                         "new for each job (the job's keys in etcd live under /jaxpg/ID/)")
        if args.min_nodes is None:  # --nnodes N with etcd: N:N
            args.min_nodes = args.nnodes
    if args.master_port is not None and not 0 < args.master_port < 65536:
        parser.error(f"--master-port must be in [1, 65535], got {args.master_port}")
    if (not args.node_rank_given and args.min_nodes is None and args.nnodes > 1
            and args.coordinator == "launcher"):
        args.min_nodes = args.nnodes  # torchrun's --nnodes N: N:N, node ranks in join order
    elif not args.node_rank_given and args.min_nodes is None and args.nnodes > 1:
        parser.error(f"--nnodes {args.nnodes} without --node-rank takes the node ranks in "
                     "the order the launchers join, which needs --coordinator launcher; "
                     "pass --node-rank on each node with --coordinator rank0")
    if args.min_nodes is not None and args.master_port is None:
        parser.error(f"--nnodes {args.min_nodes}:{args.nnodes} needs --master-port (or "
                     "--rdzv-endpoint): node 0's launcher serves the rendezvous there")
    if args.min_nodes is not None and args.coordinator != "launcher":
        parser.error("--nnodes MIN:MAX needs --coordinator launcher (node 0's launcher hosts "
                     "each attempt's coordination service)")
    if args.local_addr is not None and args.rdzv_backend != "etcd":
        parser.error("--local-addr is for --rdzv-backend etcd (with c10d, node 0's address "
                     "is --master-addr)")
    if args.master_port is None and args.nnodes > 1:
        parser.error(
            f"--nnodes {args.nnodes} needs --master-port (or --rdzv-endpoint) so that all "
            "nodes agree on the coordinator's port"
        )
    if args.module and args.no_python:
        parser.error("-m/--module and --no-python cannot be used together")
    if args.grace_period < 0:
        parser.error(f"--grace-period must be >= 0 seconds, got {args.grace_period}")
    if args.devices_per_proc is None:
        raw = os.environ.get("JAXPG_DEVICES_PER_PROC", "1")
        try:
            args.devices_per_proc = _positive_int("JAXPG_DEVICES_PER_PROC")(raw)
        except argparse.ArgumentTypeError as err:
            parser.error(str(err))
    nproc = args.nproc_per_node
    try:
        args.console_ranks = _ranks_filter(args.local_ranks_filter, nproc)
        if args.log_dir is None and (args.tee is not None or args.redirect is not None):
            flag = "--tee" if args.tee is not None else "--redirect"
            raise argparse.ArgumentTypeError(
                f"{flag} writes log files, so it needs --log-dir DIR as well"
            )
        if args.log_dir is not None and args.tee is None and args.redirect is None:
            args.tee = "3"
        args.tee_masks = _streams("--tee", args.tee, nproc)
        args.redirect_masks = _streams("--redirect", args.redirect, nproc)
    except argparse.ArgumentTypeError as err:
        parser.error(str(err))
    gpus = visible_gpus()
    needed = nproc * args.devices_per_proc
    if gpus and needed > len(gpus):
        parser.error(
            f"--nproc-per-node {nproc} x --devices-per-proc "
            f"{args.devices_per_proc} needs {needed} GPUs, but {len(gpus)} are visible"
        )
    if args.rdzv_backend == "etcd":
        _check_etcd(args, parser)
    return args
