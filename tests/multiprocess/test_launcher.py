"""jaxpg-run: environment, output prefixes, failure propagation, Ctrl-C."""

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

from jaxpg.run import main, worker_env

WORKERS = Path(__file__).parent / "workers"


def launch(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    """Runs ``python -m jaxpg.run ARGS`` with this process's environment plus ``env``."""
    return subprocess.run(
        [sys.executable, "-m", "jaxpg.run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
    )


def envs_by_rank(stdout: str) -> dict[int, dict[str, str]]:
    out = {}
    for line in stdout.splitlines():
        prefix, _, rest = line.partition("] ENV ")
        if rest:
            out[int(prefix.removeprefix("[rank "))] = json.loads(rest)
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_worker_env_replaces_the_device_count_and_shares_gpus():
    env = worker_env(
        {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_other=1"},
        rank=3,
        local_rank=1,
        world_size=4,
        local_world_size=2,
        node_rank=1,
        master_addr="10.0.0.1",
        master_port=29500,
        devices_per_proc=2,
        gpus=["4", "5", "6", "7"],
    )
    assert env["XLA_FLAGS"] == "--xla_other=1 --xla_force_host_platform_device_count=2"
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"]) == ("3", "1", "1")
    assert "GLIBC_TUNABLES" not in env  # GPU workers keep the allocator as it is


def test_cpu_workers_keep_large_buffers_in_the_heap_unless_told_otherwise():
    common = dict(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                  master_addr="127.0.0.1", master_port=1)
    env = worker_env({}, **common)
    assert env["GLIBC_TUNABLES"].startswith("glibc.malloc.mmap_threshold=33554432")
    assert worker_env({"GLIBC_TUNABLES": "mine"}, **common)["GLIBC_TUNABLES"] == "mine"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_workers_get_env_and_prefixed_output():
    # This pytest process has XLA_FLAGS for 8 devices; each worker must get 1.
    assert "device_count=8" in os.environ.get("XLA_FLAGS", "")
    # Pretend GPUs 3 and 5 are visible: each worker gets one of them.
    result = launch(
        "--nproc-per-node", "2", str(WORKERS / "echo_env.py"), "a", "--b",
        CUDA_VISIBLE_DEVICES="3,5",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    envs = envs_by_rank(result.stdout)
    assert sorted(envs) == [0, 1]
    port = envs[0]["MASTER_PORT"]
    for rank, env in envs.items():
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", port)
        assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=1"
        assert env["PYTHONUNBUFFERED"] == "1"
        assert env["CUDA_VISIBLE_DEVICES"] == "35"[rank]
        assert f'[rank {rank}] ARGS ["a", "--b"]' in result.stdout
        assert f"[rank {rank}] no newline at the end" in result.stdout
        assert f"[rank {rank}] to stderr" in result.stderr
    assert all(line.startswith("[rank ") for line in result.stdout.splitlines())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_four_workers_with_two_devices_each_and_a_module():
    result = launch(
        "--nproc_per_node=4", "--devices-per-proc", "2", "--master-port", "29555",
        str(WORKERS / "echo_env.py"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    envs = envs_by_rank(result.stdout)
    assert sorted(envs) == [0, 1, 2, 3]
    assert {e["MASTER_PORT"] for e in envs.values()} == {"29555"}
    assert {e["XLA_FLAGS"] for e in envs.values()} == {"--xla_force_host_platform_device_count=2"}
    result = launch("--nproc-per-node", "4", "-m", "platform")
    assert result.returncode == 0, result.stderr
    assert sorted(line.split("]")[0] for line in result.stdout.splitlines()) == [
        f"[rank {r}" for r in range(4)
    ]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_failing_worker_stops_the_others_and_sets_the_exit_code():
    start = time.monotonic()
    result = launch("--nproc-per-node", "3", str(WORKERS / "fail_or_sleep.py"), "1", "3")
    assert result.returncode == 3, result.stderr
    assert time.monotonic() - start < 20  # The sleepers (60 s) were stopped.
    assert "rank 1 exited with code 3" in result.stderr
    pids = [int(line.rsplit("=", 1)[1]) for line in result.stdout.splitlines() if "pid=" in line]
    assert len(pids) == 3 and not any(alive(pid) for pid in pids)
    assert "still alive" not in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigint_stops_every_worker_and_exits_130():
    command = [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", "2"]
    pids: list[int] = []
    done = threading.Event()
    with subprocess.Popen(
        [*command, str(WORKERS / "sleeper.py")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as launcher:

        def read() -> None:
            for line in launcher.stdout:
                if "pid=" in line:
                    pids.append(int(line.rsplit("=", 1)[1]))
                    if len(pids) == 2:
                        done.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            assert done.wait(timeout=30), "the workers did not start"
            launcher.send_signal(signal.SIGINT)
            assert launcher.wait(timeout=30) == 130
        finally:
            launcher.kill()
        reader.join(timeout=10)
        assert "interrupted" in launcher.stderr.read()
    assert not any(alive(pid) for pid in pids)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc-per-node", "0", "x.py"], "--nproc-per-node must be at least 1, got 0"),
        (["--nproc_per_node", "two", "x.py"], "--nproc-per-node must be an integer, got 'two'"),
        (["--rdzv-endpoint", "nohost", "x.py"], "--rdzv-endpoint must be host:port"),
        (["--nnodes", "2", "x.py"], "needs --master-port"),
        (["--nnodes", "2", "--node-rank", "2", "x.py"], "--node-rank must be in [0, --nnodes=2)"),
        (["--master-port", "70000", "x.py"], "--master-port must be in [1, 65535]"),
    ],
)
def test_bad_flags_give_a_clear_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
