"""``FileStore``: a store in one file, shared by processes on one machine (or NFS).

On-disk format, like torch's ``FileStore``: the file is an append-only log of
records, each ``struct.pack("<cII", op, len(key), len(value)) + key + value``,
where ``op`` is ``b"S"`` (set) or ``b"D"`` (delete). The store's state is the log
replayed in order. Every operation opens the file, takes an ``fcntl.flock`` lock
(shared to read, exclusive to write), reads the records appended since this
process last looked, and, for a write, appends its own records before unlocking.
Read-modify-write operations (``add``, ``compare_set``, ``append``) therefore run
under one exclusive lock and are atomic across processes.

Blocking reads poll with a short, growing sleep (1 ms up to 50 ms).

With ``world_size > 0`` the file is deleted when ``world_size`` instances have
called :meth:`FileStore.close`, as torch deletes it when its stores are destroyed;
a file must not be reused while it holds a previous run's keys.

Example:
    >>> import tempfile, os
    >>> from jaxpg.stores import FileStore
    >>> path = os.path.join(tempfile.mkdtemp(), "store")
    >>> store = FileStore(path)
    >>> store.compare_set("leader", "", "rank0")
    b'rank0'
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
import time
from collections.abc import Iterator, Sequence

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

__all__ = ["FileStore"]

_HEADER = struct.Struct("<cII")
_SET, _DELETE = b"S", b"D"
_INTERNAL = "__jaxpg_filestore__/"
_REFCOUNT = _INTERNAL + "refcount"
_CLEANUP = _INTERNAL + "cleanup"


def _record(op: bytes, key: str, value: bytes = b"") -> bytes:
    k = key.encode("utf-8")
    return _HEADER.pack(op, len(k), len(value)) + k + value


class FileStore(Store):
    """A store kept in ``file_name``, shared by every process that opens it.

    Args:
        file_name: the path of the file; created if missing.
        world_size: how many processes use the file, or -1 if unknown. When given,
            opening more stores than that raises, and the file is deleted after
            ``world_size`` calls to :meth:`close`.
        timeout: how long :meth:`get` and :meth:`wait` block; timedelta or seconds.

    Raises:
        TypeError: if ``file_name`` is not a path or ``world_size`` not an int.
        ValueError: if ``world_size`` is 0 or below -1, or the file already has
            ``world_size`` users (a stale file from an earlier run).
    """

    def __init__(
        self, file_name: str | os.PathLike, world_size: int = -1, timeout: Timeout = DEFAULT_TIMEOUT
    ) -> None:
        super().__init__(timeout)
        if not isinstance(file_name, str | os.PathLike):
            raise TypeError(f"file_name={file_name!r} must be a path (str or os.PathLike).")
        if not isinstance(world_size, int) or isinstance(world_size, bool):
            raise TypeError(f"world_size={world_size!r} must be an int.")
        if world_size == 0 or world_size < -1:
            raise ValueError(
                f"world_size={world_size} must be a positive number of processes, or -1 if unknown."
            )
        self._path = os.fspath(file_name)
        self._world_size = world_size
        self._lock = threading.Lock()
        self._data: dict[str, bytes] = {}
        self._offset = 0
        self._inode: int | None = None
        self._closed = False
        users = self.add(_REFCOUNT, 1)
        if 0 < world_size < users:
            raise ValueError(
                f"FileStore(file_name={self._path!r}, world_size={world_size}) is user number "
                f"{users}; the file probably holds a previous run's keys. Delete it, or use a "
                "fresh file for each run."
            )

    @property
    def path(self) -> str:
        """The path of the store's file."""
        return self._path

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[int]:
        """Opens and locks the file, and brings the cached state up to date."""
        if self._closed:
            raise ValueError(f"FileStore({self._path!r}) is closed; open a new one.")
        with self._lock:
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
                self._catch_up(fd)
                yield fd
            finally:
                os.close(fd)  # Also releases the flock.

    def _catch_up(self, fd: int) -> None:
        """Replays the records appended since the last call."""
        stat = os.fstat(fd)
        if stat.st_ino != self._inode or stat.st_size < self._offset:
            self._data, self._offset, self._inode = {}, 0, stat.st_ino
        if stat.st_size == self._offset:
            return
        buf = os.pread(fd, stat.st_size - self._offset, self._offset)
        pos = 0
        while pos + _HEADER.size <= len(buf):
            op, klen, vlen = _HEADER.unpack_from(buf, pos)
            end = pos + _HEADER.size + klen + vlen
            if end > len(buf):
                break  # A torn record from a writer that died; ignore the tail.
            key = buf[pos + _HEADER.size : pos + _HEADER.size + klen].decode("utf-8")
            if op == _SET:
                self._data[key] = buf[end - vlen : end]
            else:
                self._data.pop(key, None)
            pos = end
        self._offset += pos

    def _write(self, fd: int, records: list[tuple[bytes, str, bytes]]) -> None:
        """Appends records (the file is locked exclusively and caught up)."""
        blob = b"".join(_record(*r) for r in records)
        os.write(fd, blob)
        self._offset += len(blob)
        for op, key, value in records:
            if op == _SET:
                self._data[key] = value
            else:
                self._data.pop(key, None)

    def set(self, key: str, value: bytes | str) -> None:
        key, value = check_key(key), to_bytes(value)
        with self._locked(exclusive=True) as fd:
            self._write(fd, [(_SET, key, value)])

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        keys = check_keys(keys)
        if len(keys) != len(values):
            raise ValueError(
                f"multi_set got {len(keys)} keys but {len(values)} values; pass one value per key."
            )
        records = [
            (_SET, k, to_bytes(v, f"values[{i}]"))
            for i, (k, v) in enumerate(zip(keys, values, strict=True))
        ]
        with self._locked(exclusive=True) as fd:
            self._write(fd, records)

    def get(self, key: str) -> bytes:
        key = check_key(key)
        self._wait([key], self._timeout)
        with self._locked(exclusive=False):
            if key in self._data:
                return self._data[key]
        return self.get(key)  # Deleted between the wait and the read: wait again.

    def add(self, key: str, amount: int) -> int:
        key, amount = check_key(key), check_amount(amount)
        with self._locked(exclusive=True) as fd:
            current = self._data.get(key)
            total = amount + (0 if current is None else parse_counter(key, current))
            self._write(fd, [(_SET, key, str(total).encode())])
            return total

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        key = check_key(key)
        expected, desired = to_bytes(expected, "expected"), to_bytes(desired, "desired")
        with self._locked(exclusive=True) as fd:
            result = compare_set_result(self._data.get(key), expected, desired)
            if result is not None:
                return result
            self._write(fd, [(_SET, key, desired)])
            return desired

    def append(self, key: str, value: bytes | str) -> None:
        key, value = check_key(key), to_bytes(value)
        with self._locked(exclusive=True) as fd:
            self._write(fd, [(_SET, key, self._data.get(key, b"") + value)])

    def check(self, keys: Sequence[str]) -> bool:
        keys = check_keys(keys)
        with self._locked(exclusive=False):
            return all(k in self._data for k in keys)

    def delete_key(self, key: str) -> bool:
        key = check_key(key)
        with self._locked(exclusive=True) as fd:
            if key not in self._data:
                return False
            self._write(fd, [(_DELETE, key, b"")])
            return True

    def num_keys(self) -> int:
        with self._locked(exclusive=False):
            return sum(1 for k in self._data if not k.startswith(_INTERNAL))

    def _wait(self, keys: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        sleep = 0.001
        while True:
            with self._locked(exclusive=False):
                missing = [k for k in keys if k not in self._data]
            if not missing:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise timeout_error(f"FileStore({self._path!r})", missing, timeout)
            time.sleep(min(sleep, remaining))
            sleep = min(sleep * 2, 0.05)

    def close(self) -> None:
        """Releases this instance; the last of ``world_size`` closes deletes the file."""
        if self._closed:
            return
        closed = self.add(_CLEANUP, 1)
        self._closed = True
        if self._world_size > 0 and closed >= self._world_size:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._path)

    def __enter__(self) -> FileStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FileStore({self._path!r}, world_size={self._world_size}, timeout={self.timeout})"
