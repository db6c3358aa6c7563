"""SIGUSR1 and SIGTERM make a process dump: from the main thread's handler, or from the
recorder's thread while the main thread cannot run Python (one small process each)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading, time
    from jaxpg.supervision import fr_os_signals

    out = sys.argv[1]
    def dump(trigger):
        with open(out, "a") as f:
            f.write(trigger + "\\n")
    fr_os_signals.install(dump, on_term=True)
    def poll():
        while True:
            fr_os_signals.poll()
            time.sleep(0.1)
    threading.Thread(target=poll, daemon=True).start()
    if sys.argv[2] != "stuck":
        print("READY", flush=True)
        time.sleep(60)
    else:  # SIGTERM reaches another thread; this one waits on in C, in a read nothing ends
        main = threading.get_native_id()

        def ready_once_main_waits_in_c():
            # READY only once the kernel has the main thread inside read(): were it still
            # running bytecode, it would run the handler itself (the other path).
            deadline = time.monotonic() + 30
            while "pipe_read" not in open(f"/proc/self/task/{main}/wchan").read():
                if time.monotonic() > deadline:
                    print("NOT BLOCKED", flush=True)
                    return
                time.sleep(0.01)
            print("READY", flush=True)

        threading.Thread(target=ready_once_main_waits_in_c, daemon=True).start()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        never, _ = os.pipe()
        os.read(never, 1)
""")


def _start(tmp_path, mode):
    out = tmp_path / "dumps.txt"
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(out), mode],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "READY"
    return proc, out


def _wait_for(path, lines, seconds=30.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= lines:
            return path.read_text().splitlines()
        time.sleep(0.05)
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.timeout(120)
def test_sigusr1_dumps_and_sigterm_dumps_then_ends_by_sigterm(tmp_path):
    proc, out = _start(tmp_path, "plain")
    try:
        proc.send_signal(signal.SIGUSR1)
        assert _wait_for(out, 1) == ["SIGUSR1"]
        assert proc.poll() is None  # SIGUSR1 leaves it running
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.communicate()
    assert out.read_text().splitlines() == ["SIGUSR1", "SIGTERM (the job is being stopped)"]


@pytest.mark.timeout(120)
def test_sigterm_dumps_from_the_recorders_thread_when_the_main_thread_is_stuck(tmp_path):
    proc, out = _start(tmp_path, "stuck")
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.communicate()
    assert out.read_text().splitlines() == ["SIGTERM (the job is being stopped)"]
