"""The launcher's main loop for ``--nnodes MIN:MAX``: rendezvous, start, watch, repeat.

Each attempt: the nodes present meet (:class:`~jaxpg.run.elastic.ElasticNodes`), the
attempt's leader (its node rank 0: node 0 with the default rendezvous, an elected node with
``--rdzv-backend etcd``) hosts the workers' coordination service for that world, every
member starts its workers with the attempt's ``WORLD_SIZE``, ``RANK`` and ``GROUP_RANK``,
and all watch until the workers end, a worker fails, or a node leaves or joins.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from jaxpg.run.coordination import WorkerCoordinator
from jaxpg.run.elastic import ElasticNodes, ElasticSettings, RendezvousHostLost, _JobEnded

__all__ = ["run_elastic"]


def run_elastic(args: argparse.Namespace, *, run_attempt: Callable[..., tuple],
                say: Callable[[str], None], free_port: Callable[[str], int]) -> int:
    """Runs this node's launcher of an elastic job; returns its exit code.

    Args:
        args: the parsed flags.
        run_attempt, say, free_port: the launcher's own (``jaxpg.run.agent``): run one
            attempt's workers to their end, print a message, pick a free port.
    """
    _free_port, _say = free_port, say

    settings = ElasticSettings(args.min_nodes, args.nnodes, **args.rdzv_conf,
                               max_restarts=args.max_restarts)
    etcd = args.rdzv_backend == "etcd"
    coordinator: WorkerCoordinator | None = None
    nodes: ElasticNodes | None = None
    code = 1
    started = False  # whether any workers were started here
    try:
        node_id = args.node_rank if args.node_rank_given else None  # None: in join order
        if etcd:
            nodes = ElasticNodes(args.local_addr, None, node_id, args.rdzv_id,
                                 settings, _say, etcd=args.rdzv_endpoint)
        else:
            nodes = ElasticNodes(args.master_addr, args.master_port, node_id,
                                 args.rdzv_id, settings, _say)
        nodes.agree({"--nproc-per-node": args.nproc_per_node,
                     "--max-restarts": args.max_restarts})
        attempt = 0
        while True:

            def host(members: list[int]) -> int:
                nonlocal coordinator
                port = _free_port(nodes.addr)
                if args.coordinator == "launcher":
                    coordinator = WorkerCoordinator(port, len(members) * args.nproc_per_node)
                return port

            joined = nodes.rendezvous(attempt, host, code)
            if joined is None:  # a standby node: the next attempt takes it
                attempt += 1
                continue
            members, addr, port = joined
            group_rank = members.index(nodes.node_id)
            started = True
            failure, code = run_attempt(args, nodes, attempt, port, node_rank=group_rank,
                                        nnodes=len(members), master_addr=addr)
            nodes.barrier(f"stopped/{attempt}")
            if coordinator is not None:
                coordinator.shutdown()
                coordinator = None
            if failure is None:
                nodes.close(finished=True)
                return 0
            attempt += 1  # the next attempt's leader counts the restart (and may end the job)
    except _JobEnded as ended:
        if nodes is None or ended.node != nodes.node_id:
            _say(f"node {ended.node} ended the job: {ended}")
        code = ended.code
        if nodes is not None:
            nodes.close()
    except RendezvousHostLost as err:
        _say(f"{err}; stopping all workers" if started else str(err))
        code = 1
    except RuntimeError as err:  # etcd refused a request
        _say(f"rendezvous error: {err}")
        code = 1
    except TimeoutError as err:  # node 0 published nothing within join_timeout
        _say(str(err))
        code = 1
    except OSError as err:  # the script could not start, or the port is taken
        _say(f"could not start the attempt: {err}")
        code = 1
    except ValueError as err:  # the nodes disagree on a setting
        _say(str(err))
        code = 2
    except KeyboardInterrupt:
        _say("interrupted; stopping all workers")
        code = 130
    finally:
        if coordinator is not None:
            coordinator.shutdown()
    return code
