"""The abstract key/value ``Store``, with torch.distributed's method set.

A store is the small shared dictionary that processes use to meet: to agree on a
coordinator address, to count arrivals at a barrier, to hand out unique ids. Every
store in :mod:`jaxpg.stores` has the same methods and the same semantics as
``torch.distributed.Store``:

* values are ``bytes`` (a ``str`` is accepted and encoded as UTF-8);
* :meth:`Store.get` and :meth:`Store.wait` block until the keys exist, for at most
  the store's timeout, and then raise :class:`~jaxpg.errors.DistStoreError`;
* :meth:`Store.add` is an atomic counter whose value is stored as decimal bytes
  (``b"42"``), so ``get`` of a counter gives what torch gives;
* :meth:`Store.compare_set` follows torch: a missing key with an empty
  ``expected`` is created, a matching value is replaced, and the call returns the
  value the key holds afterwards (or ``expected`` when the key is missing).

Subclasses implement the abstract methods; ``multi_get`` and ``multi_set`` have
generic versions here that subclasses may make faster or atomic.
"""

from __future__ import annotations

import abc
import datetime
from collections.abc import Sequence

__all__ = ["DEFAULT_TIMEOUT", "Store", "Timeout"]

Timeout = datetime.timedelta | float | int
"""A timeout: a :class:`datetime.timedelta` or a number of seconds."""

DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)
"""torch's default store timeout: five minutes."""


def to_seconds(timeout: Timeout, name: str = "timeout") -> float:
    """Returns ``timeout`` in seconds, checking that it is a non-negative duration.

    Args:
        timeout: a :class:`datetime.timedelta` or a number of seconds.
        name: the argument's name, used in error messages.

    Raises:
        TypeError: if ``timeout`` is neither a timedelta nor a number.
        ValueError: if ``timeout`` is negative.
    """
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, int | float) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(
            f"{name}={timeout!r} must be a datetime.timedelta or a number of seconds, "
            f"not {type(timeout).__name__}."
        )
    if seconds < 0 or seconds != seconds:
        raise ValueError(f"{name}={timeout!r} must be a non-negative duration.")
    return seconds


def to_bytes(value: bytes | bytearray | memoryview | str, name: str = "value") -> bytes:
    """Returns ``value`` as ``bytes``, encoding a ``str`` as UTF-8.

    Raises:
        TypeError: if ``value`` is not bytes-like or a string.
    """
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise TypeError(
        f"{name}={value!r} must be bytes or str, not {type(value).__name__}; "
        "encode other objects yourself (for example with str(x).encode())."
    )


def check_key(key: str, name: str = "key") -> str:
    """Returns ``key`` after checking that it is a string.

    Raises:
        TypeError: if ``key`` is not a ``str``.
    """
    if not isinstance(key, str):
        raise TypeError(f"{name}={key!r} must be a str, not {type(key).__name__}.")
    return key


def check_keys(keys: Sequence[str], name: str = "keys") -> list[str]:
    """Returns ``keys`` as a list after checking that it is a sequence of strings.

    Raises:
        TypeError: if ``keys`` is a single string or holds a non-string.
    """
    if isinstance(keys, str | bytes):
        raise TypeError(f"{name}={keys!r} must be a list of keys; did you mean [{keys!r}]?")
    return [check_key(k, f"{name}[{i}]") for i, k in enumerate(keys)]


def check_amount(amount: int) -> int:
    """Returns ``amount`` after checking that it is an ``int`` (not a bool).

    Raises:
        TypeError: if ``amount`` is not an integer.
    """
    if not isinstance(amount, int) or isinstance(amount, bool):
        raise TypeError(
            f"amount={amount!r} must be an int, not {type(amount).__name__}; "
            "Store.add counts in whole numbers."
        )
    return amount


def parse_counter(key: str, value: bytes) -> int:
    """Reads a counter's decimal bytes, as :meth:`Store.add` stores them.

    Raises:
        DistStoreError: if the key holds something that is not a decimal integer.
    """
    from jaxpg.errors import DistStoreError

    try:
        return int(value.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise DistStoreError(
            f"Store.add({key!r}) found {value!r}, which is not a decimal integer; "
            "add() only works on keys that add() created or that hold decimal bytes."
        ) from None


def compare_set_result(current: bytes | None, expected: bytes, desired: bytes) -> bytes | None:
    """torch's compare_set rule, as a pure function.

    Args:
        current: the key's value, or ``None`` when the key is missing.
        expected: the value the caller expects.
        desired: the value to write when the expectation holds.

    Returns:
        ``None`` when ``desired`` must be written (the caller then returns
        ``desired``); otherwise the bytes to return without writing.
    """
    if (current is None and not expected) or (current is not None and current == expected):
        return None
    return expected if current is None else current


def timeout_error(store: str, keys: Sequence[str], seconds: float) -> Exception:
    """Builds the :class:`~jaxpg.errors.DistStoreError` for keys that never appeared.

    Args:
        store: the store's description, e.g. ``"HashStore"``.
        keys: the keys still missing.
        seconds: how long the caller waited.
    """
    from jaxpg.errors import DistStoreError

    names = ", ".join(repr(k) for k in keys)
    return DistStoreError(
        f"{store}: timed out after {seconds:g} s waiting for key(s) {names}. "
        "Check that the process that sets them is running and reached that point, "
        "or raise the timeout (store.set_timeout or the timeout argument)."
    )


class Store(abc.ABC):
    """A key/value store shared by the processes of a job (torch's ``Store``).

    Args:
        timeout: how long :meth:`get` and :meth:`wait` block before raising
            :class:`~jaxpg.errors.DistStoreError`; a timedelta or seconds.
    """

    def __init__(self, timeout: Timeout = DEFAULT_TIMEOUT) -> None:
        self._timeout = to_seconds(timeout)

    @property
    def timeout(self) -> datetime.timedelta:
        """The store's default timeout for blocking calls."""
        return datetime.timedelta(seconds=self._timeout)

    def set_timeout(self, timeout: Timeout) -> None:
        """Sets the default timeout of :meth:`get` and :meth:`wait`."""
        self._timeout = to_seconds(timeout)

    @abc.abstractmethod
    def set(self, key: str, value: bytes | str) -> None:
        """Sets ``key`` to ``value``, overwriting any previous value."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """Returns the value of ``key``, waiting up to the store's timeout for it.

        Raises:
            DistStoreError: if ``key`` does not appear within the timeout.
        """

    @abc.abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically adds ``amount`` to the counter ``key`` (missing means 0).

        Returns:
            The counter's new value. The store holds it as decimal bytes.
        """

    @abc.abstractmethod
    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Atomically sets ``key`` to ``desired`` if it holds ``expected``.

        A missing key counts as matching an empty ``expected``.

        Returns:
            ``desired`` if it was written; otherwise the current value, or
            ``expected`` when the key is missing (torch's rule).
        """

    @abc.abstractmethod
    def check(self, keys: Sequence[str]) -> bool:
        """Returns whether every key in ``keys`` exists, without waiting."""

    @abc.abstractmethod
    def delete_key(self, key: str) -> bool:
        """Deletes ``key``; returns whether it existed."""

    @abc.abstractmethod
    def num_keys(self) -> int:
        """Returns the number of keys in the store."""

    @abc.abstractmethod
    def _wait(self, keys: list[str], timeout: float) -> None:
        """Blocks until all ``keys`` exist, for at most ``timeout`` seconds."""

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        """Blocks until every key in ``keys`` exists.

        Args:
            keys: the keys to wait for.
            timeout: how long to wait; the store's timeout when ``None``.

        Raises:
            DistStoreError: if some key is still missing after ``timeout``.
        """
        keys = check_keys(keys)
        seconds = self._timeout if timeout is None else to_seconds(timeout)
        self._wait(keys, seconds)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Returns the values of ``keys``, waiting for each as :meth:`get` does."""
        keys = check_keys(keys)
        self._wait(keys, self._timeout)
        return [self.get(k) for k in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        """Sets each of ``keys`` to the value at the same position in ``values``.

        Raises:
            ValueError: if ``keys`` and ``values`` differ in length.
        """
        keys = check_keys(keys)
        if len(keys) != len(values):
            raise ValueError(
                f"multi_set got {len(keys)} keys but {len(values)} values; pass one value per key."
            )
        for k, v in zip(keys, values, strict=True):
            self.set(k, v)

    @abc.abstractmethod
    def append(self, key: str, value: bytes | str) -> None:
        """Atomically appends ``value`` to ``key``'s value, creating the key if missing."""

    def close(self) -> None:
        """Releases what the store holds (a no-op unless a subclass needs it)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(timeout={self.timeout})"
