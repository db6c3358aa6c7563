"""The launchers' rendezvous store kept in an etcd server (``--rdzv-backend etcd``).

The same calls as :class:`~jaxpg.run.rdzv_store.RendezvousClient` (``set``, ``setnx``,
``get``, ``list``, ``close``), so :mod:`jaxpg.run.elastic` runs on either; no launcher hosts
it, so any node may be lost. It speaks etcd's v3 JSON API (the HTTP gateway of its gRPC
API: ``/v3/kv/put``, ``/v3/kv/range``, ``/v3/kv/txn``, ``/v3/lease/grant``,
``/v3/lease/keepalive``, ``/v3/lease/revoke``; keys and values base64) with the standard
library. Every key lives under ``/jaxpg/<run id>/``. An *ephemeral* key is attached to this
launcher's lease (time to live: the heartbeat timeout), which :meth:`EtcdStore.keepalive`
renews: the keys of a lost launcher vanish when its lease runs out.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import threading
import time
from typing import Any

from jaxpg.run.rdzv_store import RendezvousHostLost

__all__ = ["EtcdStore", "probe_etcd"]


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode()


def _prefix_end(key: str) -> str:
    """The smallest key above every key that starts with ``key`` (etcd's range_end)."""
    raw = key.encode()
    return base64.b64encode(raw[:-1] + bytes([raw[-1] + 1])).decode()


def probe_etcd(endpoint: str, timeout: float = 5.0) -> str:
    """The gateway's path prefix (``/v3`` from etcd 3.4, ``/v3beta`` on 3.3) of the etcd at
    ``endpoint`` (``host:port``); raises ConnectionError saying why none answers there."""
    host, _, port = endpoint.rpartition(":")
    try:
        conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
        try:
            conn.request("GET", "/version")
            reply = conn.getresponse()
            body = reply.read()
        finally:
            conn.close()
    except OSError as err:
        raise ConnectionError(f"no etcd answers there ({err})") from None
    try:
        version = json.loads(body)["etcdserver"]
    except (ValueError, KeyError, TypeError):
        raise ConnectionError(f"something answers there, but not etcd (GET /version gave "
                              f"HTTP {reply.status}: {body[:80]!r})") from None
    major_minor = tuple(int(p) for p in version.split(".")[:2])
    if major_minor < (3, 3):
        raise ConnectionError(f"etcd {version} answers there; the v3 JSON API needs etcd 3.3 "
                              "or newer")
    return "/v3beta" if major_minor == (3, 3) else "/v3"


class EtcdStore:
    """The rendezvous keys of run ``run_id`` in the etcd at ``endpoint``.

    Args:
        endpoint: ``host:port`` of etcd's client URL.
        run_id: ``--rdzv-id``: the job's keys live under ``/jaxpg/<run_id>/``.
        timeout: seconds a request may keep failing (reconnecting) before it raises
            :class:`~jaxpg.run.rdzv_store.RendezvousHostLost`; also the lease's time to live.
    """

    leases = True  # ephemeral keys vanish with a lost launcher

    def __init__(self, endpoint: str, run_id: str, timeout: float):
        self.where = endpoint
        self._host, _, port = endpoint.rpartition(":")
        self._port, self._timeout = int(port), timeout
        self._api = probe_etcd(endpoint, timeout)
        self._root = f"/jaxpg/{run_id}/"
        self._lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None
        reply = self._call("/lease/grant", {"TTL": max(1, math.ceil(timeout))})
        self._lease = reply["ID"]

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        deadline = time.monotonic() + self._timeout
        data = json.dumps(body)
        while True:
            with self._lock:
                try:
                    if self._conn is None:
                        self._conn = http.client.HTTPConnection(self._host, self._port,
                                                                timeout=self._timeout)
                    self._conn.request("POST", self._api + path, data,
                                       {"Content-Type": "application/json"})
                    reply = self._conn.getresponse()
                    text = reply.read()
                    status = reply.status
                    break
                except (OSError, http.client.HTTPException) as err:
                    if self._conn is not None:
                        self._conn.close()
                    self._conn = None
                    why = err
            if time.monotonic() > deadline:
                raise RendezvousHostLost(f"lost the etcd rendezvous at {self.where}: {why}")
            time.sleep(0.2)
        result = json.loads(text)
        if "lease not found" in str(result.get("error", "")):
            raise RendezvousHostLost(f"this launcher's lease in the etcd at {self.where} "
                                     "expired (no keepalive within the heartbeat timeout)")
        if status != 200 or "error" in result:
            raise RuntimeError(f"etcd at {self.where}: {path}: "
                               f"{result.get('message') or result.get('error') or status}")
        return result

    def _put(self, key: str, value: str, ephemeral: bool) -> dict[str, Any]:
        put = {"key": _b64(self._root + key), "value": _b64(value)}
        if ephemeral:
            put["lease"] = self._lease
        return put

    def set(self, key: str, value: str, ephemeral: bool = False) -> None:
        self._call("/kv/put", self._put(key, value, ephemeral))

    def setnx(self, key: str, value: str, ephemeral: bool = False) -> str:
        """Sets ``key`` if absent (compare-and-swap on its create revision); returns the
        value it holds now."""
        k = _b64(self._root + key)
        reply = self._call("/kv/txn", {
            "compare": [{"key": k, "target": "CREATE", "result": "EQUAL",
                         "create_revision": "0"}],
            "success": [{"request_put": self._put(key, value, ephemeral)}],
            "failure": [{"request_range": {"key": k}}]})
        if reply.get("succeeded"):
            return value
        kvs = reply["responses"][0]["response_range"].get("kvs", [])
        return _unb64(kvs[0].get("value", "")) if kvs else self.setnx(key, value, ephemeral)

    def get(self, key: str) -> str | None:
        kvs = self._call("/kv/range", {"key": _b64(self._root + key)}).get("kvs", [])
        return _unb64(kvs[0].get("value", "")) if kvs else None

    def list(self, prefix: str) -> dict[str, str]:
        full = self._root + prefix
        kvs = self._call("/kv/range", {"key": _b64(full),
                                       "range_end": _prefix_end(full)}).get("kvs", [])
        skip = len(self._root)
        return {_unb64(kv["key"])[skip:]: _unb64(kv.get("value", "")) for kv in kvs}

    def keepalive(self) -> None:
        """Renews this launcher's lease; raises RendezvousHostLost if it has expired (the
        others have counted this launcher as lost)."""
        reply = self._call("/lease/keepalive", {"ID": self._lease})
        if int(reply.get("result", {}).get("TTL", 0)) <= 0:
            raise RendezvousHostLost(f"this launcher's lease in the etcd at {self.where} "
                                     "expired (no keepalive within the heartbeat timeout)")

    def close(self) -> None:
        """Revokes the lease (its ephemeral keys go at once) and closes the connection."""
        try:
            self._call("/kv/lease/revoke" if self._api == "/v3beta" else "/lease/revoke",
                       {"ID": self._lease})
        except (RendezvousHostLost, RuntimeError):
            pass
        if self._conn is not None:
            self._conn.close()
            self._conn = None
