"""The process signals that make the flight recorder dump: SIGUSR1, and SIGTERM.

* ``SIGUSR1`` (as ``kill -USR1 <pid>``): the process writes its dump and goes on.
* ``SIGTERM`` (a launcher stopping the job after another rank failed, a scheduler's
  preemption), with the recorder on and no handler of the program's own: the process writes
  its dump, then ends by SIGTERM as it would have.

Python runs a signal's handler in the main thread, between bytecodes: not while that thread
waits inside XLA (a jitted step that hangs). So the handlers only set a flag, and each
signal's number also arrives on a pipe given to ``signal.set_wakeup_fd``, which the flight
recorder's own thread reads every poll (``jaxpg.supervision.fr_requests``): it dumps on SIGUSR1,
and on SIGTERM, if the main thread did not end the process within a moment, it dumps and
ends it with status 128 + 15. A program that already uses the wakeup fd (asyncio) keeps
it; then only the flags work.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["install", "uninstall", "poll"]


class _State:
    def __init__(self) -> None:
        self.pipe: tuple[int, int] | None = None
        self.previous: dict[int, Any] = {}
        self.usr1 = threading.Event()
        self.term_at: float | None = None
        self.ending = threading.Lock()
        self.dump: Callable[[str], None] = lambda trigger: None


_st = _State()
_TERM_TRIGGER = "SIGTERM (the job is being stopped)"


def install(dump: Callable[[str], None], on_term: bool) -> None:
    """Installs the handlers (from the main thread; elsewhere it does nothing).

    Args:
        dump: writes this process's dump, given the trigger's text.
        on_term: also dump on SIGTERM (when the program has no SIGTERM handler of its own).
    """
    if threading.current_thread() is not threading.main_thread():
        return
    uninstall()
    _st.dump = dump
    _st.previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, _on_usr1)
    if on_term and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        _st.previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, _on_term)
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    if old != -1:  # the program's own (asyncio): leave it, rely on the flags
        signal.set_wakeup_fd(old)
        os.close(r)
        os.close(w)
        return
    _st.pipe = (r, w)


def uninstall() -> None:
    """Gives the signals and the wakeup fd back (from the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if _st.pipe is not None:
            signal.set_wakeup_fd(-1)
        for signum, previous in _st.previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
    except (ValueError, OSError):
        pass
    if _st.pipe is not None:
        for fd in _st.pipe:
            os.close(fd)
    _st.pipe = None
    _st.previous.clear()


def _on_usr1(signum: int, frame: Any) -> None:
    _st.usr1.set()  # the recorder's thread dumps
    previous = _st.previous.get(signal.SIGUSR1)
    if callable(previous):
        previous(signum, frame)


def _on_term(signum: int, frame: Any) -> None:
    """In the main thread: dump, then end by SIGTERM as the default action would."""
    if _st.ending.acquire(blocking=False):
        try:
            _st.dump(_TERM_TRIGGER)
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)


def poll() -> None:
    """Called by the recorder's thread every poll: dumps on SIGUSR1; on a SIGTERM that the
    main thread did not act on within half a second, dumps and ends the process."""
    seen = b""
    if _st.pipe is not None:
        try:
            seen = os.read(_st.pipe[0], 512)
        except (BlockingIOError, OSError):
            pass
    if _st.usr1.is_set() or signal.SIGUSR1 in seen:
        _st.usr1.clear()
        _st.dump("SIGUSR1")
    if signal.SIGTERM in seen and signal.SIGTERM in _st.previous and _st.term_at is None:
        _st.term_at = time.monotonic()
    if _st.term_at is not None and time.monotonic() - _st.term_at > 0.5:
        if _st.ending.acquire(blocking=False):  # the main thread is stuck (in XLA)
            try:
                _st.dump(_TERM_TRIGGER)
            finally:
                os._exit(128 + signal.SIGTERM)
