"""The launcher's last lines when a job fails: the first failure, as torchrun's error summary.

::

    [jaxpg-run] ============================================================
    [jaxpg-run] train.py FAILED
    [jaxpg-run] Root cause (first observed failure):
    [jaxpg-run]   time      : 2026-12-01 21:40:03 UTC
    [jaxpg-run]   host      : node7
    [jaxpg-run]   rank      : 1 (local_rank: 1, node: 0)
    [jaxpg-run]   exitcode  : 1 (pid: 4242)
    [jaxpg-run]   exception : ValueError: bad batch
    [jaxpg-run]   at        : train.py:12, in step
    [jaxpg-run]   error_file: /logs/job/attempt_0/1/error.json
    [jaxpg-run] Other failures: rank 0 exited with code 1 (DistNetworkError: ...)
    [jaxpg-run] ============================================================

The exception comes from the worker's error file (:mod:`jaxpg.run.error_file`), else from
the last traceback in its output. A failure on another node is named by that node's line.
"""

from __future__ import annotations

import signal
import socket
import time
from dataclasses import dataclass, field

from jaxpg.run.error_file import ErrorRecord

__all__ = ["RootCause", "describe"]

_RULE = "=" * 60


def _code_text(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"{returncode} (killed by {signal.Signals(-returncode).name})"
        except ValueError:
            return f"{returncode} (killed by signal {-returncode})"
    return str(returncode)


def describe(rank: int, returncode: int, error: ErrorRecord | None = None,
             stuck: bool = False) -> str:
    """One line for a failed rank: its exit code (or how it was counted) and exception."""
    if stuck:
        text = (f"rank {rank} with code 1 (it raised and did not exit: counted as failed; "
                "jax.distributed's shutdown waits for its peers)")
    else:
        text = f"rank {rank} exited with code {_code_text(returncode)}"
    if error is not None:
        text += f": {error.message.splitlines()[0][:300] if error.message else '?'}"
    return text


@dataclass
class RootCause:
    """The first failure of the attempt that ended the job.

    Attributes:
        message: its one-line description (:func:`describe`), as the nodes share it.
        rank: its global rank; None when another node saw it, or when it is not one
            rank's exit (``message`` names it).
        local_rank: its rank on its node.
        node: its node rank.
        pid: its process id.
        returncode: its exit status (negative: the signal that ended it).
        error: its exception, if it left one.
        error_file: its error file, where it is kept (``--log-dir``).
        stuck: it raised and did not exit, so the launcher counted it as failed.
        others: the other failures of the same attempt here, one line each.
        when: the time it was seen (seconds since the epoch).
    """

    message: str
    rank: int | None = None
    local_rank: int | None = None
    node: int | None = None
    pid: int | None = None
    returncode: int = 1
    error: ErrorRecord | None = None
    error_file: str | None = None
    stuck: bool = False
    others: list[str] = field(default_factory=list)
    when: float = field(default_factory=time.time)

    def lines(self, script: str) -> list[str]:
        """The summary's lines, without the launcher's prefix."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.when))
        out = [_RULE, f"{script} FAILED", "Root cause (first observed failure):"]
        if self.rank is None:  # another node's, or not one rank's exit
            out += [f"  time      : {stamp}", f"  failure   : {self.message}"]
        else:
            code = (f"1 (pid: {self.pid}; it raised, then did not exit: killed)"
                    if self.stuck else f"{_code_text(self.returncode)} (pid: {self.pid})")
            out += [f"  time      : {stamp}",
                    f"  host      : {socket.gethostname()}",
                    f"  rank      : {self.rank} (local_rank: {self.local_rank}, node: "
                    f"{self.node})",
                    f"  exitcode  : {code}"]
            if self.error is not None:
                out.append(f"  exception : {self.error.message.splitlines()[0][:300]}")
                if self.error.where:
                    out.append(f"  at        : {self.error.where}")
            else:
                out.append("  exception : <none: the process printed no traceback>")
            out.append(f"  error_file: {self.error_file or '<not kept: pass --log-dir>'}")
        if self.others:
            out.append("Other failures: " + "; ".join(self.others[:8]))
        out.append(_RULE)
        return out
