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

from jaxpg.run.diagnosis import diagnose, last_exception
from jaxpg.run.env import affinity_of
from jaxpg.run.error_file import ENV_VAR as ERROR_FILE_VAR
from jaxpg.run.error_file import ErrorRecord, read_error_file
from jaxpg.run.output import LineFilter, Tail, consoles, pump
from jaxpg.runtime.service_client import LOBBY_VAR

__all__ = ["EXIT_AFTER_RAISE_S", "WorkerGroup"]

EXIT_AFTER_RAISE_S = 10.0
"""Seconds a worker may live on after its error file appeared (an uncaught exception)
before it counts as failed: ``jax.distributed``'s shutdown at exit can wait for a peer
that goes on running (``--coordinator rank0``), and then the process never ends. A worker
that joined through jaxpg's ``init_process_group`` (its rank is in the attempt's lobby) is
left to jaxpg's own exit, whose waits for a lost or stopped peer end with their timeouts."""


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
        self.error_files = [env.get(ERROR_FILE_VAR) for env in envs]
        self.lobby = envs[0].get(LOBBY_VAR) if envs else None
        self.stuck: set[int] = set()  # local ranks that raised but did not exit
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
            if local_rank in self.stuck:
                out.append((self.first_rank + local_rank, 1))
            elif rc is not None and rc != 0:
                out.append((self.first_rank + local_rank, rc))
            elif rc is None and self._raised_long_ago(local_rank):
                self.stuck.add(local_rank)
                out.append((self.first_rank + local_rank, 1))
        return sorted(out, key=lambda item: item[1] >= 0)

    def _raised_long_ago(self, local_rank: int) -> bool:
        path = self.error_files[local_rank]
        try:
            if path is None or time.time() - os.path.getmtime(path) <= EXIT_AFTER_RAISE_S:
                return False
        except OSError:
            return False
        rank = str(self.first_rank + local_rank)
        return not (self.lobby and os.path.exists(os.path.join(self.lobby, rank)))

    def error(self, rank: int) -> ErrorRecord | None:
        """The exception that ended global ``rank``: its error file's, else the last
        traceback's in its output."""
        local = rank - self.first_rank
        path = self.error_files[local]
        found = read_error_file(path) if path else None
        if found is None:
            out, err = self.tails[local]
            text = last_exception(err.text()) or last_exception(out.text())
            if text is not None:
                found = ErrorRecord(text, "", time.time())
        return found

    def diagnosis(self, rank: int) -> str | None:
        """A one-line explanation of how global ``rank`` ended, from its last output."""
        local = rank - self.first_rank
        out, err = self.tails[local]
        return diagnose(out.text() + "\n" + err.text(), self.procs[local].returncode)

    def all_succeeded(self) -> bool:
        return all(p.poll() == 0 for p in self.procs)

    def _signal(self, sig: int) -> None:
        for local_rank, p in enumerate(self.procs):
            if p.poll() is None:
                try:
                    # a worker that raised but cannot exit gets no second chance
                    os.killpg(p.pid, signal.SIGKILL if local_rank in self.stuck else sig)
                    os.killpg(p.pid, signal.SIGCONT)  # a SIGSTOPped worker must see it too
                except (ProcessLookupError, PermissionError):
                    pass

    def stop(self, grace: float, sig: int = signal.SIGTERM) -> None:
        """Sends ``sig`` (the signal the launcher got, or SIGTERM) to every live worker's
        process group, waits up to ``grace`` s while any is alive, then SIGKILLs the rest.

        After another signal (SIGINT), the workers still running when one of them has
        ended get SIGTERM at once: they may be waiting in a collective for the one that
        left."""
        alive = {i for i, p in enumerate(self.procs) if p.poll() is None}
        self._signal(sig)
        escalated = sig == signal.SIGTERM
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            running = {i for i, p in enumerate(self.procs) if p.poll() is None}
            if not running:
                break
            if not escalated and running != alive:
                self._signal(signal.SIGTERM)
                escalated = True
            time.sleep(0.02)
        self._signal(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def pid(self, rank: int) -> int:
        """The process id of global ``rank``."""
        return self.procs[rank - self.first_rank].pid

    def join_output(self, timeout: float = 2.0) -> None:
        """Waits (briefly) until the workers' remaining output is copied."""
        for t in self.threads:
            t.join(timeout=timeout)
