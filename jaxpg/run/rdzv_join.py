"""Node ranks in join order, for launchers started without ``--node-rank`` (torchrun's c10d).

``jaxpg-run --nnodes 2:3 --rdzv-endpoint HOST:PORT --rdzv-id ID`` on every node, as torchrun
documents it: the launcher whose machine has HOST's address serves the rendezvous store on
PORT (:class:`~jaxpg.run.rdzv_store.RendezvousServer`) and is node 0; if a launcher on that
machine already serves it, the next one there joins as a client, as torch's c10d backend
falls back. Every other launcher connects (retrying until the rendezvous timeout) and takes
the lowest node id nobody holds, so the ids follow the order of joining; a launcher that
can neither reach the endpoint nor host it (HOST is not this machine's) says so when the
timeout ends.
"""

from __future__ import annotations

import socket
import uuid
from typing import Any

from jaxpg.run.rdzv_store import RendezvousServer

__all__ = ["claim_in_join_order", "is_local_host", "serve_if_local"]


def is_local_host(host: str) -> bool:
    """Whether ``host`` names an address of this machine (one it can bind to)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((sockaddr[0], 0))
                return True
        except OSError:
            continue
    return False


def serve_if_local(host: str, port: int) -> RendezvousServer | None:
    """The rendezvous server on ``port`` if ``host`` is this machine and the port is free;
    None otherwise (another launcher here serves it, or it is served elsewhere)."""
    if not is_local_host(host):
        return None
    try:
        return RendezvousServer(port)
    except OSError:
        return None


def claim_in_join_order(store: Any, first: int = 0, ephemeral: bool = False) -> int:
    """Takes ``names/<i>`` for the lowest ``i >= first`` that no launcher holds; returns
    ``i``. ``ephemeral``: the key goes with this launcher's lease (etcd), so a lost
    launcher's id is free again."""
    token = uuid.uuid4().hex
    node = first
    while store.setnx(f"names/{node}", token, ephemeral=ephemeral) != token:
        node += 1
    return node
