"""Copies a worker's output to the launcher's console and log files, as it comes.

Each rank's console output is buffered until a line ends (``\\n``) or a redraw begins
(``\\r``, as tqdm's progress bars draw), so a write is never split by another rank's prefix:
``print("Rank", r, "has data", x)``, which Python writes in several pieces, arrives whole.
A partial line (a prompt, a progress bar between redraws) is shown after ``IDLE_S`` seconds
without bytes. The console copy gets the ``[rank N] `` prefix at the start of every line and
of every redraw; the log file copy (``--log-dir`` with ``--tee``/``--redirect``) is the raw
output, unfiltered.

The console drops, unless ``JAXPG_DEBUG`` is set (to anything): gloo's connection chatter
(``[Gloo] Rank 0 is connected to 1 peer ranks...``, every run), and, once a rank has printed
a jaxpg error or the attempt failed, the C++ log lines (``E1125 10:00:00.000 ... file.cc:12]
...`` and the lines that continue them) that JAX's runtime writes while the job comes down.
"""

from __future__ import annotations

import os
import re
import select
import threading
from collections.abc import Callable
from typing import IO

__all__ = ["Console", "LineFilter", "Prefixer", "Tail", "consoles", "pump", "IDLE_S"]

IDLE_S = 0.3
_GLOO_CHATTER = re.compile(rb"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks")
_CPP_LOG = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [\w./+-]+:\d+\] ")
_JAXPG_ERROR = re.compile(rb"^(jaxpg\.errors\.)?Dist\w*Error: |^\[jaxpg[^\]]*\].*Dist\w*Error")
_PYTHON_LINE = re.compile(rb"^(Traceback |  File \"|\[jaxpg|[\w.]+(Error|Exception|Warning|"
                          rb"Interrupt|Exit)\b)")


def _segments(data: bytes) -> list[bytes]:
    """``data`` cut into lines (ending with ``\\n``) and redraws (starting with ``\\r``)."""
    out, start = [], 0
    for i, byte in enumerate(data):
        if byte == 0x0A:  # "\n" ends a line
            out.append(data[start:i + 1])
            start = i + 1
        elif byte == 0x0D and i > start and data[i - 1] != 0x0D:  # "\r" begins a redraw
            out.append(data[start:i])
            start = i
    if start < len(data):
        out.append(data[start:])
    return out


class Prefixer:
    """Buffers one rank's stream and inserts ``prefix`` at the start of each line or redraw.

    Args:
        prefix: the bytes to put in front, e.g. ``b"[rank 0] "``.
        keep: decides, per whole line or redraw (without its ``\\r``/``\\n``), whether the
            console shows it; None keeps everything.
    """

    def __init__(self, prefix: bytes, keep: Callable[[bytes], bool] | None = None):
        self.prefix = prefix
        self.keep = keep
        self.at_start = True  # False while this rank's console line is open
        self.pending = b""

    def feed(self, chunk: bytes) -> bytes:
        """The prefixed whole lines and redraws that ``chunk`` completes; keeps the rest."""
        data = self.pending + chunk
        cut = max(data.rfind(b"\n") + 1, data.rfind(b"\r"), 0)  # a "\r" begins a redraw
        self.pending = data[cut:]
        return self._prefixed(data[:cut])

    def take_pending(self) -> bytes:
        """The prefixed partial line held back (shown after ``IDLE_S``, or at the end)."""
        data, self.pending = self.pending, b""
        return self._prefixed(data, final=True)

    def _prefixed(self, data: bytes, final: bool = False) -> bytes:
        out = bytearray()
        for seg in _segments(data):
            text = seg.strip(b"\r\n")
            complete = seg.endswith(b"\n") or not final
            if self.keep is not None and text and complete and not self.keep(text):
                continue
            for byte in seg:
                if byte in (0x0A, 0x0D):
                    out.append(byte)
                    self.at_start = True
                else:
                    if self.at_start:
                        out += self.prefix
                        self.at_start = False
                    out.append(byte)
        return bytes(out)


class LineFilter:
    """What the console leaves out (see the module doc); one per worker group.

    ``quiet`` turns on once a rank printed a jaxpg error (or the launcher saw a failure):
    from then on C++ log lines and their continuation lines are dropped.
    """

    def __init__(self, debug: bool | None = None):
        self.debug = bool(os.environ.get("JAXPG_DEBUG", "").strip()) if debug is None else debug
        self.quiet = False

    def for_stream(self) -> Callable[[bytes], bool]:
        """A ``keep`` function for one stream of one rank."""
        in_cpp = False

        def keep(text: bytes) -> bool:
            nonlocal in_cpp
            if self.debug:
                return True
            if _GLOO_CHATTER.match(text):
                return False
            if _JAXPG_ERROR.match(text):
                self.quiet = True
            if not self.quiet:
                return True
            if _CPP_LOG.match(text):
                in_cpp = True
                return False
            if in_cpp and not _PYTHON_LINE.match(text):
                return False  # a continuation line of the C++ message
            in_cpp = False
            return True

        return keep


class Tail:
    """The last ``size`` bytes of a stream, raw (for the launcher's diagnosis)."""

    def __init__(self, size: int = 32768):
        self.size = size
        self.data = bytearray()
        self.lock = threading.Lock()

    def add(self, chunk: bytes) -> None:
        with self.lock:
            self.data += chunk
            if len(self.data) > self.size:
                del self.data[: len(self.data) - self.size]

    def text(self) -> str:
        with self.lock:
            return self.data.decode(errors="replace")


class _Screen:
    """What several consoles writing to one file share: a lock and the open line."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: tuple[Console, Prefixer] | None = None


class Console:
    """One launcher stream (stdout or stderr) shared by every worker's pump.

    A worker's line that is still open (a partial line shown after ``IDLE_S``) is ended with
    a newline before another worker writes, and its next bytes start with its prefix again,
    so every console line starts with the prefix of the rank that wrote it. Consoles made by
    :func:`consoles` for a stdout and stderr that are the same file (a terminal) share this.
    """

    def __init__(self, out: IO[bytes], screen: _Screen | None = None):
        self.out = out
        self._screen = screen or _Screen()

    def _emit(self, prefixer: Prefixer, data: bytes) -> None:
        if not data:
            return
        screen = self._screen
        if screen.open is not None and screen.open[1] is not prefixer:
            console, other = screen.open
            console.out.write(b"\n")
            console.out.flush()
            other.at_start = True
            screen.open = None
        self.out.write(data)
        self.out.flush()
        screen.open = None if prefixer.at_start else (self, prefixer)

    def write(self, prefixer: Prefixer, chunk: bytes) -> None:
        """Shows the whole lines and redraws ``chunk`` completes for ``prefixer``'s rank."""
        with self._screen.lock:
            self._emit(prefixer, prefixer.feed(chunk))

    def flush_pending(self, prefixer: Prefixer) -> None:
        """Shows ``prefixer``'s held-back partial line (it has been idle)."""
        with self._screen.lock:
            if prefixer.pending:
                self._emit(prefixer, prefixer.take_pending())

    def close(self, prefixer: Prefixer) -> None:
        """Shows what is held back and ends ``prefixer``'s open line (its stream closed)."""
        screen = self._screen
        with screen.lock:
            if prefixer.pending:
                self._emit(prefixer, prefixer.take_pending())
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


def pump(fd: int, console: Console | None, prefix: bytes, log: IO[bytes] | None = None,
         keep: Callable[[bytes], bool] | None = None, tail: Tail | None = None) -> None:
    """Copies the pipe ``fd`` to ``console`` (prefixed, filtered) and ``log`` (raw) until it
    closes.

    Args:
        fd: the read end of the worker's stdout or stderr pipe; closed at the end.
        console: the launcher's stdout or stderr, or None to leave it out
            (``--local-ranks-filter``, ``--redirect``).
        prefix: the console prefix.
        log: the per-rank log file, or None.
        keep: the console's line filter (:meth:`LineFilter.for_stream`), or None.
        tail: keeps the stream's last bytes for the launcher's diagnosis, or None.
    """
    prefixer = Prefixer(prefix, keep)
    try:
        while True:
            if console is not None and prefixer.pending:
                if not select.select([fd], [], [], IDLE_S)[0]:
                    console.flush_pending(prefixer)
                    continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            if log is not None:
                log.write(chunk)
                log.flush()
            if tail is not None:
                tail.add(chunk)
            if console is not None:
                console.write(prefixer, chunk)
        if console is not None:
            console.close(prefixer)
    finally:
        os.close(fd)
        if log is not None:
            log.close()
