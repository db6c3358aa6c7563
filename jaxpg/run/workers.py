"""One attempt's worker processes on this node: start, watch, stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from jaxpg.run.diagnosis import diagnose
from jaxpg.run.env import affinity_of
from jaxpg.run.output import LineFilter, Tail, consoles, pump

__all__ = ["WorkerGroup"]


def _die_with_parent() -> None:
    """In the child, before exec: get SIGKILL when the launcher dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _pinned_preexec(cpus: list[int] | None):
    """The child's pre-exec hook: die with the parent, and pin to ``cpus`` when given."""

    def hook() -> None:
        _die_with_parent()
        if cpus:
            try:
                os.sched_setaffinity(0, cpus)
            except OSError:
                pass  # CPUs outside this machine's set: leave the worker unpinned

    return hook


class WorkerGroup:
    """The workers of one attempt on this node, with their output pumps.

    Args:
        command: the command every worker runs.
        envs: one environment per local rank.
        first_rank: the global rank of local rank 0.
        console_ranks: the local ranks whose output goes to the console.
        tee_masks: per local rank, the streams (1 stdout, 2 stderr) also written to log files.
        redirect_masks: per local rank, the streams written to log files only.
        log_dir: this attempt's log directory (``<log dir>/<run id>/attempt_<k>``), or None.
    """

    def __init__(
        self,
        command: Sequence[str],
        envs: Sequence[dict[str, str]],
        *,
        first_rank: int,
        console_ranks: set[int],
        tee_masks: Sequence[int],
        redirect_masks: Sequence[int],
        log_dir: Path | None,
    ):
        self.first_rank = first_rank
        self.procs: list[subprocess.Popen] = []
        self.threads: list[threading.Thread] = []
        self.filter = LineFilter()
        self.tails: list[tuple[Tail, Tail]] = []
        both = consoles(sys.stdout.buffer, sys.stderr.buffer)
        for local_rank, env in enumerate(envs):
            outs = [os.pipe(), os.pipe()]
            try:
                proc = subprocess.Popen(
                    list(command),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=outs[0][1],
                    stderr=outs[1][1],
                    process_group=0,
                    preexec_fn=(_pinned_preexec(affinity_of(env))
                                if sys.platform == "linux" else None),
                )
            except OSError:
                for r, _ in outs:
                    os.close(r)
                self.stop(0.0)  # the workers already started
                raise
            finally:
                for _, w in outs:
                    os.close(w)
            self.procs.append(proc)
            tails = (Tail(), Tail())
            self.tails.append(tails)
            prefix = f"[rank {first_rank + local_rank}] ".encode()
            for bit, name, (read_end, _), console, tail in zip(
                    (1, 2), ("stdout", "stderr"), outs, both, tails):
                to_log = (tee_masks[local_rank] | redirect_masks[local_rank]) & bit
                shown = local_rank in console_ranks and not redirect_masks[local_rank] & bit
                log = None
                if log_dir is not None and to_log:
                    folder = log_dir / str(local_rank)
                    folder.mkdir(parents=True, exist_ok=True)
                    log = open(folder / f"{name}.log", "ab")  # noqa: SIM115 (closed by pump)
                t = threading.Thread(
                    target=pump, args=(read_end, console if shown else None, prefix, log,
                                       self.filter.for_stream(), tail),
                    daemon=True,
                )
                t.start()
                self.threads.append(t)

    def failed(self) -> list[tuple[int, int]]:
        """``(global rank, exit code)`` of every worker that has failed, signal deaths first
        (when a rank is killed its peers often fail right after it, in the same poll)."""
        out = []
        for local_rank, p in enumerate(self.procs):
            rc = p.poll()
            if rc is not None and rc != 0:
                out.append((self.first_rank + local_rank, rc))
        return sorted(out, key=lambda item: item[1] >= 0)

    def diagnosis(self, rank: int) -> str | None:
        """A one-line explanation of how global ``rank`` ended, from its last output."""
        local = rank - self.first_rank
        out, err = self.tails[local]
        return diagnose(out.text() + "\n" + err.text(), self.procs[local].returncode)

    def all_succeeded(self) -> bool:
        return all(p.poll() == 0 for p in self.procs)

    def stop(self, grace: float) -> None:
        """SIGTERM every live worker's process group, then SIGKILL after ``grace`` s."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in self.procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, sig)
                        if sig == signal.SIGTERM:  # a SIGSTOPped worker must see it too
                            os.killpg(p.pid, signal.SIGCONT)
                    except (ProcessLookupError, PermissionError):
                        pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
                time.sleep(0.02)
        for p in self.procs:
            p.wait()

    def join_output(self, timeout: float = 2.0) -> None:
        """Waits (briefly) until the workers' remaining output is copied."""
        for t in self.threads:
            t.join(timeout=timeout)
