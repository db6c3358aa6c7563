"""``PrefixStore``: a view of another store with every key under ``f"{prefix}/"``.

Process groups use it to give each group its own corner of the world's store, as
torch does in ``_new_process_group_helper``.

Example:
    >>> from jaxpg.stores import HashStore, PrefixStore
    >>> base = HashStore()
    >>> PrefixStore("pg1", base).set("ready", b"1")
    >>> base.get("pg1/ready")
    b'1'
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxpg.stores.store import Store, Timeout, check_key, check_keys

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """Forwards every call to ``store`` with keys prefixed by ``f"{prefix}/"``.

    The timeout is the underlying store's: :meth:`set_timeout` changes it there.
    :meth:`num_keys` counts all keys of the underlying store, as torch's does.

    Args:
        prefix: the prefix, without the trailing ``/``.
        store: the store to wrap.

    Raises:
        TypeError: if ``prefix`` is not a string or ``store`` is not a Store.
    """

    def __init__(self, prefix: str, store: Store) -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix={prefix!r} must be a str, not {type(prefix).__name__}.")
        if not isinstance(store, Store):
            raise TypeError(
                f"store={store!r} must be a jaxpg Store (HashStore, FileStore, TCPStore, ...)."
            )
        self._prefix = prefix
        self._store = store

    @property
    def underlying_store(self) -> Store:
        """The wrapped store."""
        return self._store

    @property
    def prefix(self) -> str:
        """The prefix, without the trailing ``/``."""
        return self._prefix

    @property
    def _timeout(self) -> float:  # type: ignore[override]
        return self._store.timeout.total_seconds()

    def set_timeout(self, timeout: Timeout) -> None:
        self._store.set_timeout(timeout)

    def _key(self, key: str) -> str:
        return f"{self._prefix}/{check_key(key)}"

    def _keys(self, keys: Sequence[str]) -> list[str]:
        return [f"{self._prefix}/{k}" for k in check_keys(keys)]

    def set(self, key: str, value: bytes | str) -> None:
        self._store.set(self._key(key), value)

    def get(self, key: str) -> bytes:
        return self._store.get(self._key(key))

    def add(self, key: str, amount: int) -> int:
        return self._store.add(self._key(key), amount)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._store.compare_set(self._key(key), expected, desired)

    def append(self, key: str, value: bytes | str) -> None:
        self._store.append(self._key(key), value)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self._store.multi_get(self._keys(keys))

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        self._store.multi_set(self._keys(keys), values)

    def check(self, keys: Sequence[str]) -> bool:
        return self._store.check(self._keys(keys))

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(self._key(key))

    def num_keys(self) -> int:
        return self._store.num_keys()

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        self._store.wait(self._keys(keys), timeout)

    def _wait(self, keys: list[str], timeout: float) -> None:
        self._store.wait(self._keys(keys), timeout)

    def __repr__(self) -> str:
        return f"PrefixStore({self._prefix!r}, {self._store!r})"
