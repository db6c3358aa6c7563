"""Eager semantics across real processes: async_op never blocks, the accelerator watchdog
(through the CPU world with a private switch), and desync detection."""

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

WORKER = Path(__file__).parent / "workers" / "eager_semantics_worker.py"
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(mode: str, n: int, timeout: float, handshake: Path,
         **extra: str) -> list[tuple[int, str]]:
    """Starts ``n`` workers (torch's env:// variables) and returns (exit code, output) each;
    ``handshake`` is a directory where rank 1 learns when rank 0 has ended."""
    port = _free_port()
    procs = []
    for r in range(n):
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "JAXPG_DEBUG", "TORCH_DISTRIBUTED_DEBUG",
                            "JAXPG_BLOCKING_WAIT", "TORCH_NCCL_BLOCKING_WAIT")}
        env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu",
                   XLA_FLAGS=xla_flags(1), RANK=str(r),
                   WORLD_SIZE=str(n), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), TEST_HANDSHAKE_DIR=str(handshake), **extra)
        procs.append(subprocess.Popen([sys.executable, str(WORKER), mode], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return finish(procs, timeout)


@pytest.mark.timeout(150)
def test_async_op_returns_before_its_input_is_computed_and_wait_names_missing_ranks(tmp_path):
    results = _run("async", 2, 120, tmp_path)
    assert results[0][0] == 0, results[0][1][-3000:]  # rank 1 may die with the coordinator
    for rank, (_, text) in enumerate(results):
        assert f"[rank {rank}] ASYNC returned, input ready: False" in text, text[-3000:]
        assert f"[rank {rank}] ASYNC values ok: True" in text, text[-3000:]
        assert f"[rank {rank}] PLAIN result ready on return: True" in text, text[-3000:]
        assert f"[rank {rank}] ASYNC broadcast ok: True" in text, text[-3000:]
    text0 = results[0][1]
    assert "[rank 0] ASYNC timeout returned" in text0
    waits = re.findall(r"WAIT\((\S+)\) raised after [\d.]+ s: (\w+): (.*)", text0)
    assert [w[0] for w in waits] == ["1.0", "None"], text0[-3000:]
    for _, cls, msg in waits:
        assert cls == "DistTimeoutError", msg
        assert "all_reduce #4 on group 'WORLD'" in msg, msg
        assert "ranks that did not arrive: [1]" in msg, msg


@pytest.mark.timeout(150)
def test_watchdog_ends_the_process_with_the_named_error_under_stream_semantics(tmp_path):
    results = _run("watchdog", 2, 120, tmp_path, _JAXPG_STREAM_SEMANTICS="1")
    for rank, (_, text) in enumerate(results):
        assert f"[rank {rank}] STREAM values ok: True" in text, text[-3000:]
        assert f"[rank {rank}] STREAM async ok: True" in text, text[-3000:]
    code0, text0 = results[0]
    assert code0 == 6, text0[-3000:]
    assert "WATCHDOG DID NOT FIRE" not in text0
    m = re.search(r"\[jaxpg watchdog\] DistTimeoutError: (.*)", text0)
    assert m, text0[-3000:]
    assert "all_reduce #3 on group 'WORLD'" in m.group(1)
    assert "ranks that did not arrive: [1]" in m.group(1)


def _cases(text: str) -> dict[str, tuple[str, str]]:
    return {m.group(1): (m.group(2), m.group(3)) for m in
            re.finditer(r"CASE (\w+) raised after [\d.]+ s: (\w+): (.*)", text)}


@pytest.mark.timeout(150)
def test_detail_catches_shape_and_op_mismatch_on_every_rank(tmp_path):
    results = _run("desync", 3, 120, tmp_path, JAXPG_DEBUG="DETAIL", TEST_TIMEOUT_S="20")
    for rank, (code, text) in enumerate(results):
        assert code == 0, text[-3000:]
        cases = _cases(text)
        assert set(cases) == {"shape", "op"}, text[-3000:]
        cls, msg = cases["shape"]
        assert cls == "DistDesyncError", msg
        assert "ranks [2] differ from rank 0" in msg, msg
        assert "all_reduce(group='WORLD', seq=1, x=float32[4]" in msg, msg
        assert "rank 2 is running all_reduce(group='WORLD', seq=1, x=float32[8]" in msg, msg
        cls, msg = cases["op"]
        assert cls == "DistDesyncError", msg
        assert "ranks [1] differ from rank 0" in msg, msg
        assert "rank 1 is running all_gather_into_tensor(group='WORLD', seq=2" in msg, msg
        assert f"[rank {rank}] AFTER ok: True" in text, text[-3000:]


@pytest.mark.timeout(150)
def test_with_the_check_off_a_timeout_says_what_each_rank_runs(tmp_path):
    results = _run("desync_plain", 3, 120, tmp_path, JAXPG_DEBUG="OFF")
    for code, text in results:
        assert code == 0, text[-3000:]
        cls, msg = _cases(text)["op"]
        assert cls in ("DistTimeoutError", "DistNetworkError"), msg
        assert "rank 1 is running all_gather_into_tensor(group='WORLD', seq=1" in msg, msg
        assert "JAXPG_DEBUG=DETAIL" in msg, msg
