"""TCPStore and rendezvous across real processes started by jaxpg-run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

WORKERS = Path(__file__).parent / "workers"


def launch(nproc: int, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", str(nproc), *args],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(nproc):
        assert f"[rank {rank}] OK rank {rank}" in result.stdout, result.stdout + result.stderr
    return result


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tcp_store_two_processes():
    # set/get/wait/check/multi_get, a timeout naming the key, add, compare_set race
    # (one winner), append race, PrefixStore, delete_key, then jax sees 2 devices.
    result = launch(2, str(WORKERS / "tcp_store_worker.py"), "100")
    assert "100 adds" in result.stdout and "total 200" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tcp_store_four_processes_thousand_adds_each():
    result = launch(4, str(WORKERS / "tcp_store_worker.py"), "1000")
    assert "total 4000" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("init_method", ["file", "tcp", "tcpstore"])
def test_rendezvous_and_initialize_across_processes(init_method, tmp_path):
    url = {
        "file": f"file://{tmp_path / 'rdzv'}",
        "tcp": "tcp://127.0.0.1:{port}",
        "tcpstore": "tcpstore",  # TCPStore(host, port, world_size, is_master) starts jax
    }[init_method]
    result = launch(2, str(WORKERS / "rendezvous_worker.py"), url)
    store = "FileStore" if init_method == "file" else "TCPStore"
    assert result.stdout.count(f"store {store}") == 2
    assert not (tmp_path / "rdzv").exists()  # The last FileStore.close() removed it.
