"""A worker's error file: the exception that ended it, for the launcher's error summary.

``jaxpg-run`` gives every worker ``TORCHELASTIC_ERROR_FILE``, a path of its own, as torchrun
does. The exception that ends a Python worker is written there in torch's format::

    {"message": {"message": "RuntimeError: boom",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1764624000"}}}

by :func:`record` (torch's ``@record``, for a script's entry point) or, without it, by the
``sys.excepthook`` that the launcher installs in its Python workers
(``jaxpg/run/worker_site/sitecustomize.py``). The launcher reads it to name the first
failure's exception, and a worker whose error file is there but which has not exited soon
after (``jax.distributed``'s shutdown waiting for a peer) counts as failed.

Only the standard library is used: the workers' hook loads this file before the script runs,
so it must not import JAX (a script may still set ``XLA_FLAGS`` before it does).
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["ENV_VAR", "ErrorRecord", "install_excepthook", "read_error_file", "record",
           "write_error_file"]

ENV_VAR = "TORCHELASTIC_ERROR_FILE"

_F = TypeVar("_F", bound=Callable[..., Any])
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (.+)$', re.M)


@dataclass(frozen=True)
class ErrorRecord:
    """What a worker's error file says.

    Attributes:
        message: ``"Type: text"`` of the exception.
        callstack: its formatted traceback.
        timestamp: when it was written (seconds since the epoch).
    """

    message: str
    callstack: str
    timestamp: float

    @property
    def where(self) -> str | None:
        """``file:line, in function`` of the innermost frame, if the traceback names one."""
        frames = _FRAME.findall(self.callstack)
        if not frames:
            return None
        path, line, function = frames[-1]
        return f"{path}:{line}, in {function}"


def write_error_file(error: BaseException, path: str | None = None) -> None:
    """Writes ``error`` to ``path`` (default ``$TORCHELASTIC_ERROR_FILE``); keeps a file that
    is already there (the innermost ``record`` wrote it first). Never raises."""
    path = path or os.environ.get(ENV_VAR)
    if not path or os.path.exists(path):
        return
    try:
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        body = {"message": {"message": f"{type(error).__name__}: {error}",
                            "extraInfo": {"py_callstack": text,
                                          "timestamp": str(int(time.time()))}}}
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        partial = f"{path}.{os.getpid()}.tmp"
        with open(partial, "w") as out:
            json.dump(body, out)
        os.replace(partial, path)  # the launcher never reads half a file
    except Exception:  # noqa: BLE001 (the worker's own error matters, not this one)
        pass


def read_error_file(path: str) -> ErrorRecord | None:
    """The record at ``path``, or None if there is none (or it is not one)."""
    try:
        with open(path) as f:
            body = json.load(f)["message"]
        if isinstance(body, str):  # torch also accepts a bare message
            return ErrorRecord(body, "", os.path.getmtime(path))
        extra = body.get("extraInfo", {})
        return ErrorRecord(str(body["message"]), str(extra.get("py_callstack", "")),
                           float(extra.get("timestamp", os.path.getmtime(path))))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def record(fn: _F) -> _F:
    """Writes the exception that escapes ``fn`` to the worker's error file, then re-raises
    it (torch's ``torch.distributed.elastic.multiprocessing.errors.record``)::

        from jaxpg.run import record

        @record
        def main():
            ...

    Under ``jaxpg-run`` a Python worker's uncaught exception is written anyway; ``record``
    also covers an entry point whose exception something else catches, and scripts that
    run under another launcher that sets ``TORCHELASTIC_ERROR_FILE``.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SystemExit as err:  # an exit with a code is not an exception to report
            if err.code not in (None, 0) and not isinstance(err.code, int):
                write_error_file(err)
            raise
        except BaseException as err:
            write_error_file(err)
            raise

    return wrapper  # type: ignore[return-value]


def install_excepthook() -> None:
    """Makes ``sys.excepthook`` write the error file before it prints the traceback."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: Any) -> None:
        if not issubclass(kind, KeyboardInterrupt):  # a stop asked for, not a failure
            write_error_file(error.with_traceback(tb))
        previous(kind, error, tb)

    sys.excepthook = hook
