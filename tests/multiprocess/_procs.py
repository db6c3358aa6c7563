"""Collecting worker processes' output under one deadline, and stopping a daemon (shared by
the multi-process tests)."""

from __future__ import annotations

import subprocess
import time


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """Waits for every process within ``timeout`` s in all; a hung one is killed and marked."""
    out = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
            text += "\n<killed: hung>"
        out.append((p.returncode, text))
    return out


def stop(proc: subprocess.Popen, grace: float) -> None:
    """Stops ``proc`` if it still runs: SIGTERM, then SIGKILL after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
