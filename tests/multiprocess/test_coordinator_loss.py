"""Without the launcher (plain processes, rank 0 hosts the coordination service): a lost
rank 0 makes every survivor raise a Python ``DistNetworkError`` naming rank 0, not JAX's C++
fatal error, and rank 0's service child does not outlive its linger."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _child_env import child_env

from jaxpg.internal import free_port
from jaxpg.runtime.coordinator_process import linger_seconds

WORKER = Path(__file__).parent / "workers" / "coordinator_loss.py"
LINGER_S = 15  # more than the heartbeat timeout: the survivors learn of the loss first
CPP_ABORTS = ("Terminating process because", "Check failure stack trace", "terminate called",
              "exception not rethrown")


def _start(world: int, case: str, handshake: Path | None = None) -> list[subprocess.Popen]:
    env = child_env()
    if handshake is not None:
        env["JAXPG_TEST_HANDSHAKE_DIR"] = str(handshake)
    # docs/launcher.md: a heartbeat timeout under 10 s declares live ranks dead on a loaded
    # machine. The group timeout (40 s) stays well above it, so a lost rank is found by the
    # heartbeat (DistNetworkError), never by the group timeout.
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", JAXPG_HEARTBEAT_TIMEOUT="10",
               JAXPG_COORDINATOR_LINGER=str(LINGER_S))
    port = free_port()
    return [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(port), case,
                              "40"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
            for r in range(world)]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie waiting for its reaper is gone too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.slow
@pytest.mark.parametrize("case, world", [("killduring", 3), ("stop", 2)])
def test_lost_rank0_is_a_named_python_error_in_every_survivor(case, world):
    procs = _start(world, case)
    try:
        outs = []
        for p in procs[1:]:  # the survivors end by themselves: group timeout 40 s, not hit
            out, _ = p.communicate(timeout=120)
            outs.append((p.returncode, out))
    finally:
        procs[0].send_signal(signal.SIGCONT)
        procs[0].kill()
        for p in procs:
            if p.poll() is None:
                p.kill()
    text0, _ = procs[0].communicate(timeout=30)
    for rc, out in outs:
        assert rc == 1, out[-3000:]
        assert re.search(r"DistNetworkError: all_reduce #2 on group 'WORLD'"
                         r".*lost ranks \[0\]", out), out[-3000:]
        assert "Traceback (most recent call last)" in out
        assert not any(a in out for a in CPP_ABORTS), out[-3000:]
        assert "DONE" not in out
    service = re.search(r"SERVICE_PID (\d+)", text0)
    assert service, text0[-2000:]
    pid = int(service.group(1))
    deadline = time.monotonic() + LINGER_S + 15
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = not _gone(pid)
    if left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"rank 0's coordination-service child {pid} outlived its linger"


@pytest.mark.slow
def test_store_get_waiting_on_a_lost_rank_names_it(tmp_path):
    """A ``TCPStore.get`` (and ``wait``, ``multi_get``) whose key only the lost rank would set
    raises ``DistNetworkError`` naming it within the heartbeat timeout, not a bare timeout
    after the store's 300 s; so do ``new_group``'s store barrier and ``save_checkpoint``
    (docs/debugging.md, "A lost rank")."""
    procs = _start(3, "storeget", tmp_path)
    try:
        outs = [p.communicate(timeout=150)[0] for p in procs]  # 3 starts: ~90 s at load 35
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[1].returncode == -signal.SIGKILL
    for p, out in ((procs[0], outs[0]), (procs[2], outs[2])):
        assert p.returncode == 1, out[-3000:]
        for call in ("wait", "multi_get"):  # each names the lost rank too
            assert re.search(rf"CAUGHT {call} DistNetworkError: TCPStore.get\('set by rank 1'\)"
                             r": lost ranks \[1\]", out), out[-3000:]
        assert re.search(r"DistNetworkError: TCPStore.get\('set by rank 1'\): lost ranks \[1\]",
                         out), out[-3000:]
        assert re.search(r"CAUGHT new_group DistNetworkError: new_group 'group1' \(store "
                         r"barrier 'barrier/created'\): lost ranks \[1\]", out), out[-3000:]
        assert re.search(r"CAUGHT save_checkpoint DistNetworkError: save_checkpoint #1 on group "
                         r"'WORLD' \(store barrier .*\): lost ranks \[1\]", out), out[-3000:]
        assert not any(a in out for a in CPP_ABORTS), out[-3000:]


@pytest.mark.slow
def test_sys_exit_status_survives_a_stuck_collective():
    """A script that catches the loss of a stopped peer (its collective thread stays stuck in
    XLA, so jaxpg ends the process itself at exit) exits with the status it gave sys.exit."""
    procs = _start(2, "exit3")
    try:
        out, _ = procs[0].communicate(timeout=150)
    finally:
        procs[1].send_signal(signal.SIGCONT)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert "CAUGHT DistNetworkError" in out and "lost ranks [1]" in out, out[-3000:]
    assert procs[0].returncode == 3, out[-3000:]
    assert not any(a in out for a in CPP_ABORTS), out[-3000:]


def test_linger_setting_is_checked(monkeypatch):
    monkeypatch.setenv("JAXPG_COORDINATOR_LINGER", "soon")
    with pytest.raises(ValueError, match="JAXPG_COORDINATOR_LINGER='soon'"):
        linger_seconds(3)
    monkeypatch.setenv("JAXPG_COORDINATOR_LINGER", "7")
    assert linger_seconds(3) == 7
    monkeypatch.delenv("JAXPG_COORDINATOR_LINGER")
    assert linger_seconds(3) == 30 and linger_seconds(20) == 60
