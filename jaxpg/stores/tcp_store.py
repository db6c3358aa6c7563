"""``TCPStore``: the store of a multi-process job, on JAX's coordination service.

torch's ``TCPStore`` runs its own server socket on the master. jaxpg does not: the
processes already share a key/value store, the one in JAX's coordination service
(started by ``jax.distributed.initialize`` on process 0 and reached through
``jax.distributed``'s client, :func:`jaxpg._jax_compat.distributed_state`). ``TCPStore`` is
that store behind torch's method set. Its ``host_name:port`` is the coordinator's address.

Layout in the coordination service. Every key lives under
``jaxpg_store/<namespace>/k/<escaped key>``, where escaping replaces ``%`` and ``/``
(so that no user key is a directory of another: the service deletes a key's whole
directory with it); the per-key locks live under ``jaxpg_store/<namespace>/lock/``.

How each operation is made atomic across processes:

* ``add`` is the service's own atomic ``key_value_increment``, which keeps the
  counter as decimal bytes, exactly as torch does. One RPC, no lock.
* ``compare_set``, ``append``, ``set``, ``multi_set`` and ``delete_key`` take a
  per-key lock first. The lock is ``key_value_set(lock_key, owner,
  allow_overwrite=False)``: the service creates a key only once, so exactly one
  caller succeeds and the others see ``ALREADY_EXISTS``, sleep with a growing,
  jittered backoff (0.5 ms to 20 ms) and retry; the holder releases the lock by
  deleting the key. Locks are taken in sorted key order, so ``multi_set`` cannot
  deadlock. Under the lock, read-compare-write is atomic with respect to every
  other locked operation. ``add`` does not lock, so mixing ``add`` and
  ``compare_set`` on the same key at the same time is not atomic; torch programs
  use counters and compare-and-set keys separately.
* ``get``, ``wait``, ``check``, ``multi_get`` and ``num_keys`` are plain reads
  (blocking reads wait in the service, not by polling).

A process that dies while holding a lock (a window of two RPCs) leaves it held:
the others then fail with :class:`~jaxpg.errors.DistStoreError` after the timeout,
which is what torch's callers see when the master goes away.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from jaxpg.errors import DistNetworkError, DistStoreError
from jaxpg.runtime.coordination_service import global_client, start_jax_distributed
from jaxpg.stores.store import (
    DEFAULT_TIMEOUT,
    Store,
    Timeout,
    check_amount,
    check_key,
    check_keys,
    compare_set_result,
    timeout_error,
    to_bytes,
)

__all__ = ["TCPStore"]

_MAX_MS = 2**31 - 1
_SLICE_S = 1.0  # a blocking read looks at the world's liveness this often
_wait_checks: list[Callable[[str], None]] = []


def add_wait_check(check: Callable[[str], None]) -> None:
    """Registers ``check(what)``, called between the slices of a blocking read; it raises to
    end the wait (``jaxpg.supervision.liveness`` registers one that names lost ranks)."""
    if check not in _wait_checks:
        _wait_checks.append(check)


def _while_waiting(what: str) -> None:
    for check in _wait_checks:
        check(what)
_owner_ids = itertools.count()


def _escape(key: str) -> str:
    return key.replace("%", "%25").replace("/", "%2F")


def _unescape(name: str) -> str:
    return name.replace("%2F", "/").replace("%25", "%")


def _ms(seconds: float) -> int:
    return int(min(max(seconds * 1000.0, 1.0), _MAX_MS))


def _status(err: Exception) -> str:
    """The gRPC status name at the start of a JaxRuntimeError's message."""
    return str(err).split(":", 1)[0].strip()


class TCPStore(Store):
    """torch's ``TCPStore`` API over JAX's coordination-service key/value store.

    Which coordination service it uses, in order:

    1. ``client``, when given (a ``DistributedRuntimeClient``);
    2. the running one, when ``jax.distributed`` is initialized (``host_name`` and
       ``port``, if given, must then match its coordinator address);
    3. otherwise it initializes ``jax.distributed`` itself, through
       :func:`jaxpg.runtime.coordination_service.start_jax_distributed`, with the coordinator at
       ``host_name:port``, ``world_size`` processes and this process's ``rank``
       (``0`` when ``is_master``, else the ``RANK`` environment variable). This must
       happen before JAX initializes its backends.

    Args:
        host_name: the coordinator's host (process 0's address).
        port: the coordinator's port.
        world_size: the number of processes; needed only to initialize.
        is_master: whether this is process 0 (it then hosts the service).
        timeout: how long blocking calls wait; timedelta or seconds.
        wait_for_workers: accepted for torch compatibility; connecting to the
            coordination service already waits for every process.
        rank: this process's id when initializing; overrides ``is_master``/``RANK``.
        client: an existing coordination-service client to use.
        namespace: keeps stores with different namespaces apart in one service.

    Raises:
        ValueError: if the arguments disagree with the running service, or are
            missing when the service must be started.
    """

    def __init__(
        self,
        host_name: str | None = None,
        port: int | None = None,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: Timeout = DEFAULT_TIMEOUT,
        wait_for_workers: bool = True,
        *,
        rank: int | None = None,
        client: Any | None = None,
        namespace: str = "default",
    ) -> None:
        super().__init__(timeout)
        del wait_for_workers
        if client is None:
            client = global_client()
            if client is None:
                client = self._start(host_name, port, world_size, is_master, rank)
            else:
                self._check_address(host_name, port)
        self._setup(client, namespace)

    @classmethod
    def _from_client(
        cls, client: Any, *, timeout: Timeout = DEFAULT_TIMEOUT, namespace: str = "default"
    ) -> TCPStore:
        """A store over ``client`` (what ``init_process_group`` uses)."""
        return cls(client=client, timeout=timeout, namespace=namespace)

    def _setup(self, client: Any, namespace: str) -> None:
        if not isinstance(namespace, str) or not namespace or "/" in namespace:
            raise ValueError(f"namespace={namespace!r} must be a non-empty str without '/'.")
        self._client = client
        self._namespace = namespace
        self._root = f"jaxpg_store/{namespace}"
        self._owner = f"{os.getpid()}-{next(_owner_ids)}"

    def _start(
        self,
        host_name: str | None,
        port: int | None,
        world_size: int | None,
        is_master: bool,
        rank: int | None,
    ) -> Any:
        if host_name is None or port is None or world_size is None:
            raise ValueError(
                "TCPStore needs host_name, port and world_size to start jax.distributed "
                f"(got host_name={host_name!r}, port={port!r}, world_size={world_size!r}); "
                "pass them, or call jax.distributed.initialize / init_process_group first."
            )
        if rank is None:
            if is_master:
                rank = 0
            elif "RANK" in os.environ:
                rank = int(os.environ["RANK"])
            else:
                raise ValueError(
                    "TCPStore cannot tell this process's rank: pass rank=..., set "
                    "is_master=True on process 0, or set the RANK environment variable."
                )
        if is_master and rank != 0:
            raise ValueError(f"is_master=True but rank={rank}; the master is rank 0.")
        return start_jax_distributed(f"{host_name}:{port}", world_size, rank,
                                     timeout=self._timeout)

    @staticmethod
    def _check_address(host_name: str | None, port: int | None) -> None:
        from jaxpg._jax_compat import distributed_state

        running = distributed_state().coordinator_address or ""
        host, _, running_port = running.rpartition(":")
        if (host_name is not None and host_name != host) or (
            port is not None and str(port) != running_port
        ):
            raise ValueError(
                f"TCPStore(host_name={host_name!r}, port={port!r}) does not match the running "
                f"jax.distributed coordinator at {running!r}; leave host_name and port out "
                "to use the running one."
            )

    @property
    def host(self) -> str:
        """The coordinator's host."""
        from jaxpg._jax_compat import distributed_state

        return (distributed_state().coordinator_address or "").rpartition(":")[0]

    @property
    def port(self) -> int:
        """The coordinator's port."""
        from jaxpg._jax_compat import distributed_state

        address = distributed_state().coordinator_address or ":-1"
        return int(address.rpartition(":")[2])

    def _kv(self, key: str) -> str:
        return f"{self._root}/k/{_escape(key)}"

    def _fail(self, op: str, key: str, err: Exception) -> Exception:
        cls = DistNetworkError if _status(err) == "UNAVAILABLE" else DistStoreError
        return cls(f"TCPStore.{op}({key!r}) failed in the coordination service: {err}")

    def _try_get(self, key: str) -> bytes | None:
        try:
            return self._client.key_value_try_get_bytes(self._kv(key))
        except Exception as err:
            if _status(err) == "NOT_FOUND":
                return None
            raise self._fail("get", key, err) from err

    def _put(self, key: str, value: bytes) -> None:
        try:
            self._client.key_value_set_bytes(self._kv(key), value, allow_overwrite=True)
        except Exception as err:
            raise self._fail("set", key, err) from err

    @contextlib.contextmanager
    def _locked(self, keys: Sequence[str]) -> Iterator[None]:
        """Holds the per-key locks of ``keys`` (taken in sorted order)."""
        token = f"{self._owner}-{threading.get_ident()}"
        deadline = time.monotonic() + self._timeout
        held: list[str] = []
        try:
            for key in sorted(set(keys)):
                self._acquire(key, token, deadline)
                held.append(key)
            yield
        finally:
            for key in reversed(held):
                with contextlib.suppress(Exception):
                    self._client.key_value_delete(f"{self._root}/lock/{_escape(key)}")

    def _acquire(self, key: str, token: str, deadline: float) -> None:
        lock = f"{self._root}/lock/{_escape(key)}"
        sleep = 0.0005
        while True:
            try:
                self._client.key_value_set(lock, token, allow_overwrite=False)
                return
            except Exception as err:
                if _status(err) != "ALREADY_EXISTS":
                    raise self._fail("lock", key, err) from err
            if time.monotonic() >= deadline:
                raise DistStoreError(
                    f"TCPStore: could not lock key {key!r} within {self._timeout:g} s; another "
                    "process holds it and may have died. Restart the job."
                )
            time.sleep(sleep * (0.5 + random.random()))
            sleep = min(sleep * 2, 0.02)

    def set(self, key: str, value: bytes | str) -> None:
        key, value = check_key(key), to_bytes(value)
        with self._locked([key]):
            self._put(key, value)

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        keys = check_keys(keys)
        if len(keys) != len(values):
            raise ValueError(
                f"multi_set got {len(keys)} keys but {len(values)} values; pass one value per key."
            )
        encoded = [to_bytes(v, f"values[{i}]") for i, v in enumerate(values)]
        with self._locked(keys):
            for key, value in zip(keys, encoded, strict=True):
                self._put(key, value)

    def get(self, key: str) -> bytes:
        key = check_key(key)
        return self._blocking_get(key, self._timeout)

    def _blocking_get(self, key: str, timeout: float) -> bytes:
        value = self._get_or_none(key, timeout)
        if value is None:
            raise timeout_error("TCPStore", [key], timeout)
        return value

    def _get_or_none(self, key: str, timeout: float) -> bytes | None:
        """Waits for ``key`` in the service; ``None`` if it is still missing after ``timeout``.

        A key already set is returned at once. Else it waits in slices of at most
        ``_SLICE_S``; between them, a process of the world that the coordination service
        lost raises ``DistNetworkError`` naming it (the key may be due from it), rather than
        a bare timeout long after.
        """
        what = f"TCPStore.get({key!r})"
        deadline = time.monotonic() + timeout
        present = self._try_get(key)  # a key that is there is read, whoever was lost
        if present is not None:
            return present
        while True:
            _while_waiting(what)
            left = deadline - time.monotonic()
            try:
                return self._client.blocking_key_value_get_bytes(
                    self._kv(key), _ms(min(max(left, 0.0), _SLICE_S)))
            except Exception as err:
                if _status(err) != "DEADLINE_EXCEEDED":
                    _while_waiting(what)
                    raise self._fail("get", key, err) from err
            if left <= _SLICE_S:
                _while_waiting(what)
                return None

    def add(self, key: str, amount: int) -> int:
        key, amount = check_key(key), check_amount(amount)
        try:
            return int(self._client.key_value_increment(self._kv(key), amount))
        except Exception as err:
            raise self._fail("add", key, err) from err

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        key = check_key(key)
        expected, desired = to_bytes(expected, "expected"), to_bytes(desired, "desired")
        with self._locked([key]):
            result = compare_set_result(self._try_get(key), expected, desired)
            if result is not None:
                return result
            self._put(key, desired)
            return desired

    def append(self, key: str, value: bytes | str) -> None:
        key, value = check_key(key), to_bytes(value)
        with self._locked([key]):
            self._put(key, (self._try_get(key) or b"") + value)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        keys = check_keys(keys)
        deadline = time.monotonic() + self._timeout
        return [self._blocking_get(k, max(deadline - time.monotonic(), 0.0)) for k in keys]

    def check(self, keys: Sequence[str]) -> bool:
        return all(self._try_get(k) is not None for k in check_keys(keys))

    def delete_key(self, key: str) -> bool:
        key = check_key(key)
        with self._locked([key]):
            if self._try_get(key) is None:
                return False
            try:
                self._client.key_value_delete(self._kv(key))
            except Exception as err:
                raise self._fail("delete_key", key, err) from err
            return True

    def num_keys(self) -> int:
        try:
            return len(self._client.key_value_dir_get_bytes(f"{self._root}/k"))
        except Exception as err:
            raise self._fail("num_keys", "", err) from err

    def keys(self) -> list[str]:
        """Returns every key of this namespace (a jaxpg extension, for debugging)."""
        prefix = f"{self._root}/k/"
        entries = self._client.key_value_dir_get_bytes(f"{self._root}/k")
        return sorted(_unescape(name.removeprefix(prefix)) for name, _ in entries)

    def _wait(self, keys: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for key in keys:
            if self._get_or_none(key, max(deadline - time.monotonic(), 0.0)) is None:
                missing = [k for k in keys if self._try_get(k) is None]
                raise timeout_error("TCPStore", missing or [key], timeout)

    def __repr__(self) -> str:
        return f"TCPStore(namespace={self._namespace!r}, timeout={self.timeout})"
