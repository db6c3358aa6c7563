"""Copies a worker's output to the launcher's console and log files, as it comes.

Each worker stream is read in chunks as soon as bytes arrive (no waiting for a newline), so
progress bars that redraw with carriage returns (tqdm) update live. The console copy gets
the ``[rank N] `` prefix at the start of every line and of every redraw (after ``\\r``); the
log file copy (``--log-dir`` with ``--tee``/``--redirect``) is the raw output.
"""

from __future__ import annotations

import os
import threading
from typing import IO

__all__ = ["Console", "Prefixer", "consoles", "pump"]

_SEPARATORS = b"\r\n"


class Prefixer:
    """Inserts ``prefix`` at the start of each line or redraw of a byte stream.

    Args:
        prefix: the bytes to put in front, e.g. ``b"[rank 0] "``.
    """

    def __init__(self, prefix: bytes):
        self.prefix = prefix
        self.at_start = True

    def feed(self, chunk: bytes) -> bytes:
        """The prefixed copy of ``chunk`` (remembers whether a line is open)."""
        out = bytearray()
        start = 0
        for i, byte in enumerate(chunk):
            if byte in _SEPARATORS:
                if i > start:
                    if self.at_start:
                        out += self.prefix
                    out += chunk[start:i]
                out.append(byte)
                self.at_start = True
                start = i + 1
        if start < len(chunk):
            if self.at_start:
                out += self.prefix
            out += chunk[start:]
            self.at_start = False
        return bytes(out)


class _Screen:
    """What several consoles writing to one file share: a lock and the open line."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: tuple[Console, Prefixer] | None = None


class Console:
    """One launcher stream (stdout or stderr) shared by every worker's pump.

    A worker's line that is still open (no newline yet, e.g. a progress bar) is ended with a
    newline before another worker writes, and its next bytes start with its prefix again, so
    every console line starts with the prefix of the rank that wrote it. Consoles made by
    :func:`consoles` for a stdout and stderr that are the same file (a terminal) share this.
    """

    def __init__(self, out: IO[bytes], screen: _Screen | None = None):
        self.out = out
        self._screen = screen or _Screen()

    def write(self, prefixer: Prefixer, chunk: bytes) -> None:
        screen = self._screen
        with screen.lock:
            if screen.open is not None and screen.open[1] is not prefixer:
                console, other = screen.open
                console.out.write(b"\n")
                console.out.flush()
                other.at_start = True
            self.out.write(prefixer.feed(chunk))
            self.out.flush()
            screen.open = None if prefixer.at_start else (self, prefixer)

    def close(self, prefixer: Prefixer) -> None:
        """Ends ``prefixer``'s open line, if any (its stream closed)."""
        screen = self._screen
        with screen.lock:
            if screen.open is not None and screen.open[1] is prefixer:
                self.out.write(b"\n")
                self.out.flush()
                screen.open = None
                prefixer.at_start = True


def consoles(stdout: IO[bytes], stderr: IO[bytes]) -> tuple[Console, Console]:
    """Consoles for the launcher's stdout and stderr; one screen if both are one file."""
    try:
        same = os.path.samestat(os.fstat(stdout.fileno()), os.fstat(stderr.fileno()))
    except (OSError, ValueError, AttributeError):
        same = False
    screen = _Screen() if same else None
    return Console(stdout, screen), Console(stderr, screen)


def pump(fd: int, console: Console | None, prefix: bytes, log: IO[bytes] | None = None) -> None:
    """Copies the pipe ``fd`` to ``console`` (prefixed) and ``log`` (raw) until it closes.

    Args:
        fd: the read end of the worker's stdout or stderr pipe; closed at the end.
        console: the launcher's stdout or stderr, or None to leave it out
            (``--local-ranks-filter``, ``--redirect``).
        prefix: the console prefix.
        log: the per-rank log file, or None.
    """
    prefixer = Prefixer(prefix)
    try:
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            if log is not None:
                log.write(chunk)
                log.flush()
            if console is not None:
                console.write(prefixer, chunk)
        if console is not None:
            console.close(prefixer)
    finally:
        os.close(fd)
        if log is not None:
            log.close()
