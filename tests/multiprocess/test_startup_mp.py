"""Startup failures are named Python errors within the timeout, never JAX's C++ abort.

A process whose peers never come raises ``DistTimeoutError`` from ``init_process_group``
naming the ranks that never joined (or the coordinator's address), for every rendezvous
form, with and without ``jaxpg-run``; a rank whose coordinator could not start (the port
is in use) gets an error too. Only the processes that do start are started here: the
others "never arrive". Bounds are the timeout plus 20 s (the machine may be loaded); hangs
are caught by pytest-timeout.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _child_env import xla_flags
from _procs import finish

WORKERS = Path(__file__).parent / "workers"
TIMEOUT_S = 5.0
BOUND_S = TIMEOUT_S + 20.0
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(init_method: str, rank: int, world: int, **env: str) -> subprocess.Popen:
    full = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                         "JAXPG_COORDINATOR_HOSTED", "JAXPG_RUN_LOBBY")}
    full.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu",
                XLA_FLAGS=xla_flags(1), **env)
    return subprocess.Popen(
        [sys.executable, str(WORKERS / "startup_worker.py"), init_method, str(rank), str(world),
         str(TIMEOUT_S)], env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _raised(text: str) -> tuple[float, str, str]:
    found = re.search(r"RAISED after ([\d.]+) s: (\w+): (.*)", text)
    assert found, text[-3000:]
    return float(found.group(1)), found.group(2), found.group(3)


@pytest.mark.timeout(150)
def test_missing_ranks_are_named_for_every_rendezvous_form(tmp_path):
    """Each case starts only some processes of its world, all cases at once."""
    tcp0, tcp1, env0, fs0, store0 = (_free_port() for _ in range(5))
    cases = {  # name: (process, what the error must say)
        "tcp, a non-coordinator missing": (
            _start(f"tcp://127.0.0.1:{tcp0}", 0, 2),
            ["DistTimeoutError", "1 of 2 processes joined", "ranks that never joined: [1]"]),
        "tcp, the coordinator missing": (
            _start(f"tcp://127.0.0.1:{tcp1}", 1, 2),
            ["DistTimeoutError", f"could not reach the coordinator at 127.0.0.1:{tcp1}",
             "ranks that never joined: [0]"]),
        "env, two of three missing": (
            _start("env://", 0, 3, RANK="0", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(env0)),
            ["DistTimeoutError", "1 of 3 processes joined", "ranks that never joined: [1, 2]"]),
        "env, in-process service, one missing": (
            _start("env://", 0, 2, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(fs0), JAXPG_COORDINATOR_PROCESS="0"),
            ["DistTimeoutError", "1 of 2 processes joined", "ranks that never joined: [1]"]),
        "store=TCPStore, a non-coordinator missing": (
            _start(f"store:127.0.0.1:{store0}", 0, 2),
            ["DistTimeoutError", "1 of 2 processes joined", "ranks that never joined: [1]"]),
        "file, a non-coordinator missing": (
            _start(f"file://{tmp_path / 'a'}", 0, 2),
            ["DistTimeoutError", "1 of 2 processes joined", "ranks that never joined: [1]"]),
        "file, the coordinator missing": (
            _start(f"file://{tmp_path / 'b'}", 1, 2),
            ["DistTimeoutError", "rank 0 did not publish", "ranks that never joined: [0]"]),
    }
    results = finish([proc for proc, _ in cases.values()], 120)
    for (name, (_, wanted)), (code, text) in zip(cases.items(), results):
        assert code == 17, f"{name}: exit {code}\n{text[-3000:]}"
        assert "Terminating process" not in text and "client.h" not in text, (name, text)
        seconds, kind, message = _raised(text)
        assert seconds < BOUND_S, (name, seconds)
        for piece in wanted:
            assert piece in f"{kind}: {message}", (name, piece, message)


@pytest.mark.timeout(150)
def test_a_coordinator_port_in_use_fails_every_rank_with_a_named_error():
    with socket.socket() as taken:  # another program holds the port and answers nothing
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        procs = [_start(f"tcp://127.0.0.1:{port}", r, 2) for r in range(2)]
        results = finish(procs, 120)
    (code0, text0), (code1, text1) = results
    assert code0 == 17 and code1 == 17, text0[-2000:] + text1[-2000:]
    seconds0, kind0, message0 = _raised(text0)
    assert kind0 == "DistBackendError" and f"port {port} is in use" in message0, message0
    seconds1, kind1, message1 = _raised(text1)
    assert kind1 == "DistTimeoutError", message1
    assert f"127.0.0.1:{port}" in message1 and "port may have been in use" in message1
    assert max(seconds0, seconds1) < BOUND_S


@pytest.mark.timeout(150)
def test_the_launcher_names_a_rank_that_never_reached_init():
    result = subprocess.run(
        [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", "2",
         str(WORKERS / "late_joiner.py"), "1", str(TIMEOUT_S)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    err = result.stderr
    assert "[rank 0] jaxpg.errors.DistTimeoutError: init_process_group: 1 of 2 processes " \
           "joined" in err, err[-3000:]
    assert "ranks that never joined: [1]" in err
    # the launcher's own report, per rank, after the worker's output
    report = err[err.index("[jaxpg-run] rank 0 exited with code 1"):]
    assert "[jaxpg-run] rank 0: DistTimeoutError: init_process_group" in report
    assert "Terminating process" not in err and not re.search(r"^\[rank \d\] [IWEF]\d{4} ",
                                                              err, re.M)
