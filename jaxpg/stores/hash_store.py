"""``HashStore``: an in-process, thread-safe store (torch's ``HashStore``).

Useful for a single-process world and for tests: every method takes one lock, and
blocked readers sleep on a condition variable that every write wakes.

Example:
    >>> from jaxpg.stores import HashStore
    >>> store = HashStore()
    >>> store.add("count", 2)
    2
    >>> store.get("count")
    b'2'
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from jaxpg.stores.store import (
    DEFAULT_TIMEOUT,
    Store,
    Timeout,
    check_amount,
    check_key,
    check_keys,
    compare_set_result,
    parse_counter,
    timeout_error,
    to_bytes,
)

__all__ = ["HashStore"]


class HashStore(Store):
    """A dictionary behind a lock, shared by the threads of one process.

    Args:
        timeout: how long :meth:`get` and :meth:`wait` block; timedelta or seconds.
    """

    def __init__(self, timeout: Timeout = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout)
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: bytes | str) -> None:
        key, value = check_key(key), to_bytes(value)
        with self._cond:
            self._data[key] = value
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        key = check_key(key)
        with self._cond:
            self._wait_locked([key], self._timeout)
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        key = check_key(key)
        check_amount(amount)
        with self._cond:
            current = self._data.get(key)
            total = amount + (0 if current is None else parse_counter(key, current))
            self._data[key] = str(total).encode()
            self._cond.notify_all()
            return total

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        key = check_key(key)
        expected, desired = to_bytes(expected, "expected"), to_bytes(desired, "desired")
        with self._cond:
            result = compare_set_result(self._data.get(key), expected, desired)
            if result is not None:
                return result
            self._data[key] = desired
            self._cond.notify_all()
            return desired

    def append(self, key: str, value: bytes | str) -> None:
        key, value = check_key(key), to_bytes(value)
        with self._cond:
            self._data[key] = self._data.get(key, b"") + value
            self._cond.notify_all()

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        keys = check_keys(keys)
        if len(keys) != len(values):
            raise ValueError(
                f"multi_set got {len(keys)} keys but {len(values)} values; pass one value per key."
            )
        encoded = [to_bytes(v, f"values[{i}]") for i, v in enumerate(values)]
        with self._cond:
            self._data.update(zip(keys, encoded, strict=True))
            self._cond.notify_all()

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        keys = check_keys(keys)
        with self._cond:
            self._wait_locked(keys, self._timeout)
            return [self._data[k] for k in keys]

    def check(self, keys: Sequence[str]) -> bool:
        keys = check_keys(keys)
        with self._cond:
            return all(k in self._data for k in keys)

    def delete_key(self, key: str) -> bool:
        key = check_key(key)
        with self._cond:
            return self._data.pop(key, None) is not None

    def num_keys(self) -> int:
        with self._cond:
            return len(self._data)

    def _wait(self, keys: list[str], timeout: float) -> None:
        with self._cond:
            self._wait_locked(keys, timeout)

    def _wait_locked(self, keys: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            missing = [k for k in keys if k not in self._data]
            if not missing:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise timeout_error("HashStore", missing, timeout)
            self._cond.wait(remaining)
