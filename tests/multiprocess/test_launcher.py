"""jaxpg-run: environment, live prefixed output and log files, failure propagation, Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _child_env import xla_flags

from jaxpg.internal import free_port
from jaxpg.run import main, worker_env
from jaxpg.run.output import Console, Prefixer

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


def test_script_options_that_prefix_launcher_flags_stay_the_scripts():
    from jaxpg.run.cli import parse_args

    args = parse_args(["--nproc-per-node", "2", "train.py", "--n", "2", "--nproc", "3"])
    assert args.nproc_per_node == 2
    assert args.training_script == "train.py"
    assert args.training_script_args == ["--n", "2", "--nproc", "3"]


def test_prefix_goes_before_every_line_and_redraw_once_it_is_whole():
    p = Prefixer(b"[rank 0] ")
    chunks = [b"\r 10%|#", b"#  |\r 20%", b"|\nhello\nwor", b"ld\n", b"\r\n"]
    assert [p.feed(c) for c in chunks] == [
        b"", b"\r[rank 0]  10%|##  |", b"\r[rank 0]  20%|\n[rank 0] hello\n",
        b"[rank 0] world\n", b"\r\n",
    ]  # fmt: skip
    assert p.feed(b"partial") == b"" and p.take_pending() == b"[rank 0] partial"


def test_one_ranks_print_is_never_split_by_anothers():
    import io

    out = io.BytesIO()
    console = Console(out)
    a, b = Prefixer(b"[rank 0] "), Prefixer(b"[rank 1] ")
    for piece in (b"Rank ", b"0", b" has data ", b"[1. 1.]", b"\n"):  # print()'s writes
        console.write(a, piece)
        console.write(b, piece.replace(b"0", b"1"))
    console.close(a)
    console.close(b)
    assert out.getvalue() == b"[rank 0] Rank 0 has data [1. 1.]\n[rank 1] Rank 1 has data [1. 1.]\n"


def test_console_ends_an_open_line_before_another_rank_writes():
    import io

    out = io.BytesIO()
    console = Console(out)
    a, b = Prefixer(b"[rank 0] "), Prefixer(b"[rank 1] ")
    console.write(a, b"\r 10%")
    console.flush_pending(a)  # a bar left open for a while is shown
    console.write(b, b"a line\n")
    console.write(a, b"\r 20%")
    console.close(a)
    assert out.getvalue() == b"\r[rank 0]  10%\n[rank 1] a line\n\r[rank 0]  20%\n"


def test_gloo_chatter_and_cpp_logs_after_a_jaxpg_error_are_left_out():
    import io

    from jaxpg.run.output import LineFilter

    def run(debug):
        out = io.BytesIO()
        console, filt = Console(out), LineFilter(debug=debug)
        p = Prefixer(b"[rank 0] ", filt.for_stream())
        console.write(p, b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of "
                         b"connected peer ranks is : 1\nW1125 10:00:00.000001 12 a.cc:3] early\n")
        console.write(p, b"jaxpg.errors.DistTimeoutError: all_reduce ... [1].\n")
        console.write(p, b"E1125 10:00:01.000001 12 coordination_service.cc:9] Stopping\n\n"
                         b"Original error: ABORTED\nTraceback (most recent call last):\n")
        console.close(p)
        return out.getvalue().decode()

    shown = run(debug=False)
    assert "[Gloo]" not in shown and "Stopping" not in shown and "Original error" not in shown
    assert "early" in shown  # before any error, C++ lines are left alone
    assert "DistTimeoutError" in shown and "[rank 0] Traceback" in shown
    assert "[Gloo]" in run(debug=True) and "Stopping" in run(debug=True)


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
        assert env["XLA_FLAGS"] == xla_flags(1)  # the same flags, with 1 device
        assert env["PYTHONUNBUFFERED"] == "1"
        assert env["CUDA_VISIBLE_DEVICES"] == "35"[rank]
        assert f'[rank {rank}] ARGS ["a", "--b"]' in result.stdout
        assert f"[rank {rank}] no newline at the end" in result.stdout
        assert f"[rank {rank}] to stderr" in result.stderr
    assert all(line.startswith("[rank ") for line in result.stdout.splitlines())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_four_workers_with_two_devices_each_and_a_module():
    port = str(free_port())  # a fixed port could be taken by the other CI leg
    result = launch(
        "--nproc_per_node=4", "--devices-per-proc", "2", "--master-port", port,
        str(WORKERS / "echo_env.py"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    envs = envs_by_rank(result.stdout)
    assert sorted(envs) == [0, 1, 2, 3]
    assert {e["MASTER_PORT"] for e in envs.values()} == {port}
    assert {e["XLA_FLAGS"] for e in envs.values()} == {xla_flags(2)}
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
    # SIGINT ignored here, as in a background job of a non-interactive shell (CI's legs): the
    # launcher must still stop on it (it did not, until it set its own handler)
    command = [sys.executable, "-c", "import runpy, signal, sys; "
               "signal.signal(signal.SIGINT, signal.SIG_IGN); sys.argv = sys.argv[1:]; "
               "runpy.run_module('jaxpg.run', run_name='__main__')", "jaxpg-run",
               "--nproc-per-node", "2"]
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
        (["--max-restarts", "-1", "x.py"], "--max-restarts must be at least 0, got -1"),
        (["--tee", "3", "x.py"], "--tee writes log files, so it needs --log-dir"),
        (["--log-dir", "d", "--tee", "5", "x.py"], "--tee must be 0, 1 (stdout), 2 (stderr)"),
        (["--log-dir", "d", "--redirect", "4:1", "x.py"], "names local rank 4, but"),
        (["--local-ranks-filter", "0,3", "x.py"], "names local ranks [3], but the local ranks"),
        (["--local-ranks-filter", "a", "x.py"], "--local-ranks-filter must be local ranks"),
    ],
)
def test_bad_flags_give_a_clear_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_carriage_return_redraws_arrive_while_the_worker_draws(tmp_path):
    # The worker waits for an ack of each redraw before drawing the next one.
    command = [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", "2",
               str(WORKERS / "drawer.py"), str(tmp_path)]
    seen = b""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as launcher:
        try:
            fd = launcher.stdout.fileno()
            for k in range(3):
                while f"\r[rank 0] step {k}".encode() not in seen:
                    chunk = os.read(fd, 4096)
                    assert chunk, (seen, launcher.stderr.read())
                    seen += chunk
                (tmp_path / str(k)).touch()
            rest, err = launcher.communicate(timeout=60)
        finally:
            launcher.kill()
    out = (seen + rest).decode()
    assert launcher.returncode == 0, err
    assert "\r[rank 0] done\n" in out
    assert "[rank 1] hello from rank 1\n" in out
    # every line and every redraw starts with its rank's prefix
    for piece in re.split(r"[\r\n]", out):
        assert piece == "" or piece.startswith("[rank "), repr(piece)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_local_ranks_filter_tee_and_log_dir(tmp_path):
    result = launch("--nproc-per-node", "3", "--local-ranks-filter", "1", "--log-dir",
                    str(tmp_path), "--rdzv-id", "r1", str(WORKERS / "echo_env.py"))
    assert result.returncode == 0, result.stderr
    assert sorted(envs_by_rank(result.stdout)) == [1]  # the console shows local rank 1 only
    assert "[rank 0]" not in result.stderr and "[rank 1] to stderr" in result.stderr
    for r in range(3):  # every rank's raw output in its files (tee 3 by default)
        folder = tmp_path / "r1" / "attempt_0" / str(r)
        stdout = (folder / "stdout.log").read_text()
        assert stdout.startswith("ENV ") and stdout.endswith("no newline at the end")
        assert json.loads(stdout.splitlines()[0][4:])["RANK"] == str(r)
        assert (folder / "stderr.log").read_text() == "to stderr\n"
    result = launch("--nproc-per-node", "2", "--log-dir", str(tmp_path), "--rdzv-id", "r2",
                    "--redirect", "0:1", str(WORKERS / "echo_env.py"))
    assert result.returncode == 0, result.stderr
    assert sorted(envs_by_rank(result.stdout)) == [1]  # rank 0's stdout only in its file
    assert "[rank 0] to stderr" in result.stderr
    assert (tmp_path / "r2" / "attempt_0" / "0" / "stdout.log").read_text().startswith("ENV ")
    assert not (tmp_path / "r2" / "attempt_0" / "0" / "stderr.log").exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("coordinator", ["launcher", "rank0"])
def test_worlds_can_be_made_again_whoever_hosts_the_coordinator(coordinator):
    result = launch("--nproc-per-node", "2", "--coordinator", coordinator,
                    str(WORKERS / "reinit_worker.py"), JAX_PLATFORMS="cpu")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    for r in range(2):
        assert f"[rank {r}] RESULT 0 [1.0, 1.0]" in result.stdout
        assert f"[rank {r}] RESULT 1 [3.0, 3.0]" in result.stdout
    hosted = re.findall(r"HOSTED (\S+)", result.stdout)
    assert len(hosted) == 2
    assert all(h == "None" for h in hosted) == (coordinator == "rank0")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_master_port_in_use_is_named_not_a_crash():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = launch("--master-port", str(port), str(WORKERS / "echo_env.py"))
    assert result.returncode == 1
    assert f"port {port} is in use on this machine" in result.stderr
    assert "ENV" not in result.stdout  # no worker started


def test_a_rank_ending_with_its_own_code_while_the_others_stop_is_named_too(tmp_path):
    # rank 1 is still ending on its own error (here: when the stop reaches it) after rank 0
    # failed: the launcher names it with its own exit code, not only the first failure
    worker, ready = tmp_path / "late.py", tmp_path / "ready"
    worker.write_text(
        "import os, signal, sys, time\n"
        "if os.environ['RANK'] == '0':  # fails once rank 1's handler is in place\n"
        f"    deadline = time.monotonic() + 60\n"
        f"    while not os.path.exists({str(ready)!r}) and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n"
        "    sys.exit(3)\n"
        "def late(*_):\n"
        "    print('RuntimeError: rank 1 fails late', file=sys.stderr, flush=True)\n"
        "    os._exit(5)\n"
        "signal.signal(signal.SIGTERM, late)\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "time.sleep(60)\n")
    result = launch("--nproc-per-node", "2", str(worker))
    assert result.returncode == 3, result.stderr
    assert "rank 0 exited with code 3; stopping the other workers" in result.stderr
    assert "rank 1 exited with code 5 on its own while the others were stopped" in \
        result.stderr, result.stderr
