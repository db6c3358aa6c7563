"""One line that explains why a worker died, read from the end of its output.

When XLA's gloo collectives or JAX's coordination client end a worker in C++ (SIGABRT), the
worker's last lines are C++ text that names no rank and suggests nothing. ``jaxpg-run``
prints, after the worker's output, a diagnosis such as::

    [jaxpg-run] rank 0: shapes differ across ranks (gloo received 8 bytes where this rank
    expected 4): rerun with JAXPG_DEBUG=DETAIL to name the ranks and their shapes

A worker that ended with a jaxpg error gets that error's first line instead, so a failure
at startup (``init_process_group``'s ``DistTimeoutError``) is reported per rank.
"""

from __future__ import annotations

import re

__all__ = ["diagnose", "last_exception"]

_SIZES = re.compile(r"op\.preamble\.length <= op\.nbytes\.\s*(\d+) vs (\d+)")
_JAXPG_ERROR = re.compile(r"^(?:jaxpg\.errors\.)?(Dist\w*Error: .*)$", re.M)
_FATAL_STATUS = re.compile(r"absl::Status: ([A-Z_]+)")


def _gloo_sizes(text: str) -> str | None:
    found = _SIZES.search(text)
    if found:
        got, expected = found.groups()
        return (f"shapes differ across ranks (gloo received {got} bytes where this rank "
                f"expected {expected}): rerun with JAXPG_DEBUG=DETAIL to name the ranks and "
                "their shapes")
    if ("EnforceNotMet" in text or "Received data size doesn't match" in text
            or "op.preamble.length" in text):
        return ("shapes differ across ranks (gloo's message sizes did not match): rerun with "
                "JAXPG_DEBUG=DETAIL to name the ranks and their shapes")
    return None


def _coordination(text: str) -> str | None:
    if "Terminating process because the JAX distributed service detected fatal errors" in text:
        status = _FATAL_STATUS.search(text)
        code = status.group(1) if status else "an error"
        if "RegisterTask" in text:
            return (f"JAX's coordination client ended the process ({code} in RegisterTask): "
                    "not every process joined within the initialization timeout; with "
                    "jaxpg.init_process_group this is a DistTimeoutError naming the missing "
                    "ranks instead")
        return (f"JAX's coordination service reported a fatal error ({code}): another process "
                "died or the coordinator went away, or this process stalled past the "
                "heartbeat timeout (JAXPG_HEARTBEAT_TIMEOUT); see the first failure above")
    if "std::bad_cast" in text and "terminate called" in text:
        return ("JAX's coordination client ended the process: the service reported a fatal "
                "error for it (another process died or the coordinator went away, or this "
                "process stalled past the heartbeat timeout, JAXPG_HEARTBEAT_TIMEOUT); see "
                "the first failure above")
    return None


def last_exception(output: str) -> str | None:
    """The exception line (``Type: text``) of the last Python traceback in ``output``."""
    start = output.rfind("Traceback (most recent call last):")
    if start < 0:
        return None
    for line in output[start:].splitlines()[1:]:
        if line and not line[0].isspace() and not line.startswith("During handling"):
            return line.strip()[:400]
    return None


def diagnose(output: str, returncode: int) -> str | None:
    """A one-line diagnosis of a worker's end from its last output, or None.

    Args:
        output: the end of the worker's stdout and stderr.
        returncode: its exit status (negative: the signal that ended it).
    """
    for reading in (_gloo_sizes, _coordination):
        found = reading(output)
        if found:
            return found
    if "FATAL: exception not rethrown" in output:
        return ("a thread waiting in an XLA collective was woken while the interpreter shut "
                "down; an earlier error on this or another rank is the cause")
    errors = _JAXPG_ERROR.findall(output)
    if errors:
        line = errors[-1].strip()
        return line if len(line) <= 400 else line[:397] + "..."
    if returncode == -9:
        return "killed by SIGKILL with no message: the out-of-memory killer, or a user"
    return None
