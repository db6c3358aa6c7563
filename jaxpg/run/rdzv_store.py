"""The small key/value store the launchers of an elastic job meet through.

Node 0's launcher serves it on ``--master-port``; every launcher (node 0's included) is a
client. It carries only the launchers' control messages (membership, heartbeats, each
attempt's coordinator port, failures), never tensor bytes: the workers still meet in JAX's
coordination service, one per attempt. It is not JAX's coordination service because that
service has a fixed number of tasks (its ``connect`` waits for all of them) and ends a
client whose service is gone with a C++ fatal error; here a lost server is a Python
:class:`RendezvousHostLost` that names it.

Protocol: one JSON object per line each way. Requests ``{"op": "set"|"setnx"|"get"|"list",
"key": ..., "value": ...}``; ``setnx`` sets a key only if absent and returns what it holds;
``list`` returns every key under a prefix.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
from typing import Any

__all__ = ["RendezvousServer", "RendezvousClient", "RendezvousHostLost"]


class RendezvousHostLost(ConnectionError):
    """The rendezvous store (node 0's launcher, or the etcd server) cannot be reached."""


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        server: RendezvousServer = self.server.owner  # type: ignore[attr-defined]
        for line in self.rfile:
            try:
                reply = server.apply(json.loads(line))
            except Exception as err:  # noqa: BLE001 (a bad request gets its error back)
                reply = {"error": f"{type(err).__name__}: {err}"}
            self.wfile.write(json.dumps(reply).encode() + b"\n")


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class RendezvousServer:
    """Serves the store on all interfaces at ``port``, in a background thread."""

    def __init__(self, port: int):
        self._data: dict[str, str] = {}
        self._lock = threading.Lock()
        self._server = _TCPServer(("", port), _Handler)
        self._server.owner = self  # type: ignore[attr-defined]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def apply(self, request: dict[str, Any]) -> dict[str, Any]:
        op, key = request["op"], request.get("key", "")
        with self._lock:
            if op == "set":
                self._data[key] = request["value"]
                return {"value": request["value"]}
            if op == "setnx":
                return {"value": self._data.setdefault(key, request["value"])}
            if op == "get":
                return {"value": self._data.get(key)}
            if op == "list":
                return {"value": {k: v for k, v in self._data.items() if k.startswith(key)}}
        raise ValueError(f"unknown op {op!r}")

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class RendezvousClient:
    """A connection to node 0's :class:`RendezvousServer`.

    Args:
        host: node 0's address.
        port: its ``--master-port``.
        timeout: seconds to keep trying to connect, and the longest a request may take;
            past it (or on a refused or reset connection) requests raise
            :class:`RendezvousHostLost`.
    """

    def __init__(self, host: str, port: int, timeout: float):
        self.where = f"{host}:{port}"
        self._lock = threading.Lock()
        self._timeout = timeout
        deadline = _now() + timeout
        while True:
            try:
                self._sock = socket.create_connection((host, port), timeout=timeout)
                break
            except OSError as err:
                if _now() >= deadline:
                    raise RendezvousHostLost(
                        f"could not reach node 0's launcher (the rendezvous at {self.where}) "
                        f"within {timeout:.0f} s: {err}") from None
                threading.Event().wait(0.2)
        self._file = self._sock.makefile("rwb")

    def _call(self, **request: Any) -> Any:
        with self._lock:
            try:
                self._file.write(json.dumps(request).encode() + b"\n")
                self._file.flush()
                line = self._file.readline()
            except OSError as err:
                raise RendezvousHostLost(self._lost(str(err))) from None
        if not line:
            raise RendezvousHostLost(self._lost("the connection was closed"))
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"rendezvous at {self.where}: {reply['error']}")
        return reply["value"]

    def _lost(self, why: str) -> str:
        return f"lost node 0's launcher (the rendezvous host at {self.where}): {why}"

    leases = False  # no key vanishes: a lost launcher is seen by its silent heartbeat

    def set(self, key: str, value: str, ephemeral: bool = False) -> None:
        self._call(op="set", key=key, value=value)

    def setnx(self, key: str, value: str, ephemeral: bool = False) -> str:
        """Sets ``key`` if absent; returns the value it holds now (``ephemeral``: see
        :class:`~jaxpg.run.rdzv_etcd.EtcdStore`; every key here lives as long as the
        server)."""
        return self._call(op="setnx", key=key, value=value)

    def get(self, key: str) -> str | None:
        return self._call(op="get", key=key)

    def list(self, prefix: str) -> dict[str, str]:
        return self._call(op="list", key=prefix)

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


def _now() -> float:
    import time

    return time.monotonic()
