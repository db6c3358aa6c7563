"""jaxpg-run's stops: SIGTERM and SIGINT end training workers within seconds (JAX's preemption
notifier no longer swallows SIGTERM), a failed worker's peers are stopped at once, the
launcher's last lines name the first failure (torchrun's error summary, with the error
file), and a script's own ``jax.distributed.initialize`` is refused with the fix under the
launcher's coordinator, or, under ``--coordinator rank0``, a rank that raised but cannot
exit counts as failed, so ``--max-restarts`` restarts the job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _child_env import child_env

from jaxpg.run.diagnosis import last_exception
from jaxpg.run.error_file import read_error_file, record

WORKER = str(Path(__file__).parent / "workers" / "stop_worker.py")
GRACE = "60"  # a stop that waits out the grace period fails every bound below


class Launcher:
    """``python -m jaxpg.run ARGS``, its output collected with arrival times."""

    def __init__(self, *args: str):
        self.start = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxpg.run", "--grace-period", GRACE, *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=child_env(JAX_PLATFORMS="cpu"))
        self.lines: list[tuple[float, str]] = []
        self.readers = [threading.Thread(target=self._read, args=(s,), daemon=True)
                        for s in (self.proc.stdout, self.proc.stderr)]
        for reader in self.readers:
            reader.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def text(self) -> str:
        return "\n".join(line for _, line in list(self.lines))

    def wait_for(self, needle: str, count: int = 1, timeout: float = 90) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = [t for t, line in list(self.lines) if needle in line]
            if len(hits) >= count:
                return hits[count - 1]
            time.sleep(0.05)
        raise AssertionError(f"{needle!r} x{count} not seen within {timeout} s:\n"
                             + self.text()[-3000:])

    def finish(self, timeout: float) -> tuple[int, float]:
        code = None
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            for reader in self.readers:
                reader.join(timeout=10)
            self.proc.stdout.close()
            self.proc.stderr.close()
        return code, time.monotonic()

    def pids(self) -> list[int]:
        return [int(line.rsplit("=", 1)[1]) for _, line in list(self.lines) if "pid=" in line]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_error_files_in_torchs_format_and_the_last_traceback(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    @record
    def main():
        raise ValueError("bad batch")

    with pytest.raises(ValueError):
        main()
    body = json.loads(path.read_text())["message"]
    assert body["message"] == "ValueError: bad batch"
    assert "raise ValueError" in body["extraInfo"]["py_callstack"]
    found = read_error_file(str(path))
    assert found.message == "ValueError: bad batch"
    assert found.where.endswith(", in main") and "test_launcher_stops.py:" in found.where
    assert read_error_file(str(tmp_path / "missing.json")) is None
    text = ("Traceback (most recent call last):\n  File \"a.py\", line 1\nKeyError: 1\n\n"
            "During handling of the above exception, another exception occurred:\n\n"
            "Traceback (most recent call last):\n  File \"a.py\", line 3, in f\n"
            "    g()\nRuntimeError: second\nexit noise\n")
    assert last_exception(text) == "RuntimeError: second"
    assert last_exception("no traceback here") is None


def test_jaxs_preemption_sync_only_where_the_environment_asks_for_it(monkeypatch):
    import jax

    from jaxpg.runtime.hosted_coordinator import preemption_sync_asked

    monkeypatch.delenv("JAX_ENABLE_PREEMPTION_SERVICE", raising=False)
    assert jax.config.jax_enable_preemption_service  # JAX's default, which does not count
    assert not preemption_sync_asked()
    monkeypatch.setenv("JAX_ENABLE_PREEMPTION_SERVICE", "1")
    assert preemption_sync_asked()
    try:
        jax.config.update("jax_enable_preemption_service", False)
        assert not preemption_sync_asked()
    finally:
        jax.config.update("jax_enable_preemption_service", True)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_the_launcher_ends_training_workers_within_seconds(sig, code):
    launcher = Launcher("--nproc-per-node", "2", WORKER, "train")
    launcher.wait_for("training", count=2)
    time.sleep(1.0)
    launcher.proc.send_signal(sig)
    sent = time.monotonic()
    got, ended = launcher.finish(timeout=120)
    assert got == code, launcher.text()[-3000:]
    # Bound: the workers end at once on the signal (JAX's preemption notifier used to keep
    # them training until --grace-period 60 ran out); + 10 s for a loaded machine.
    assert ended - sent < 10, (ended - sent, launcher.text()[-3000:])
    assert len(launcher.pids()) == 2 and not any(_alive(p) for p in launcher.pids())
    assert "FAILED" not in launcher.text()  # a stop asked for is no failure to summarize


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_raising_worker_stops_its_peers_at_once_and_the_last_lines_name_it(tmp_path):
    launcher = Launcher("--nproc-per-node", "2", "--log-dir", str(tmp_path), "--rdzv-id",
                        "job", WORKER, "train", "1")
    failed = launcher.wait_for("rank 1 exited with code 1")
    code, ended = launcher.finish(timeout=120)
    assert code == 1, launcher.text()[-3000:]
    # Bound: rank 0, blocked in an all_reduce with rank 1, is stopped at once (it used to
    # wait for gloo to notice, then out the grace period); + 10 s for a loaded machine.
    assert ended - failed < 10, (ended - failed, launcher.text()[-3000:])
    stderr_lines = [line for _, line in launcher.lines if line.startswith("[jaxpg-run]")]
    summary = "\n".join(stderr_lines[-11:])
    assert stderr_lines[-1].endswith("=" * 60), summary
    assert "stop_worker.py FAILED" in summary
    assert "rank      : 1 (local_rank: 1, node: 0)" in summary
    assert "exitcode  : 1 (pid: " in summary
    assert "exception : ValueError: bad batch" in summary
    assert "stop_worker.py:24, in <module>" in summary  # the raise's line
    error_file = tmp_path / "job" / "attempt_0" / "1" / "error.json"
    assert f"error_file: {error_file}" in summary
    assert read_error_file(str(error_file)).message == "ValueError: bad batch"
    assert not any(_alive(p) for p in launcher.pids())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_scripts_own_initialize_is_refused_under_the_launchers_coordinator():
    # Rank 0 would host a second service on the launcher's port (gRPC's SO_REUSEPORT):
    # processes split between the two hung in initialize. It is named with the fix.
    launcher = Launcher("--nproc-per-node", "2", WORKER, "own_init", "60")
    code, _ = launcher.finish(timeout=120)
    assert code == 1, launcher.text()[-3000:]
    text = launcher.text()
    assert "rank 0 started a JAX coordination service of its own on port" in text
    assert "run jaxpg-run with --coordinator rank0" in text
    assert "DONE" not in text


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_rank_that_raised_but_cannot_exit_counts_as_failed_and_restarts():
    # --coordinator rank0: rank 1's exit waits in jax.distributed's shutdown for rank 0,
    # which sleeps 120 s; the launcher counts rank 1 failed and restarts the group.
    launcher = Launcher("--nproc-per-node", "2", "--coordinator", "rank0", "--max-restarts",
                        "1", WORKER, "own_init", "120")
    raised = launcher.wait_for("RuntimeError: rank 1 fails")
    code, ended = launcher.finish(timeout=150)
    text = launcher.text()
    assert code == 0, text[-3000:]
    assert "rank 1 with code 1 (it raised and did not exit: counted as failed" in text
    assert "restarting the whole group" in text
    assert text.count("DONE") == 2  # both ranks of attempt 1
    # Bound: EXIT_AFTER_RAISE_S (10 s), the stop, and attempt 1's start (two processes that
    # import JAX: up to 30 s on a loaded machine); rank 0's 120 s sleep is far above it.
    assert ended - raised < 60, (ended - raised, text[-3000:])
