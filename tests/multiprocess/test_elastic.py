"""jaxpg-run --max-restarts: torchrun's variables, and DDP runs that lose a rank and resume
from their checkpoints to exactly the parameters of an uninterrupted run (a seeded
fault-injection suite: a Python error, a death while a checkpoint is committed, a SIGSTOPped
rank, a death inside a step's collectives, a kill after a checkpoint, an asynchronous
checkpoint's commit killed, a kill at a random step and a cut newest checkpoint, chained
through the attempts of one launch)."""

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

import numpy as np
import pytest
from _child_env import child_env

WORKERS = Path(__file__).parent / "workers"
EXAMPLE = Path(__file__).parents[2] / "examples" / "ddp_digits.py"
STEPS = 9
pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    env = child_env()
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **extra)
    return env


def launch(args: list[str], timeout: float = 150, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxpg.run", *args], capture_output=True,
                          text=True, timeout=timeout, env=_env(**env))


def train(tmp: Path, name: str, fault: str, restarts: int = 2, timeout: float = 150,
          **env: str):
    """Runs elastic_ddp.py on 2 workers; returns (result, rank 0's final parameters)."""
    out = tmp / f"{name}.npz"
    result = launch(["--nproc-per-node", "2", "--max-restarts", str(restarts),
                     "--grace-period", "2", str(WORKERS / "elastic_ddp.py"),
                     str(tmp / name), str(out), str(STEPS), fault], timeout=timeout, **env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("DONE") == 2
    return result, dict(np.load(out))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The parameters of an uninterrupted run."""
    result, params = train(tmp_path_factory.mktemp("ref"), "ref", "none", restarts=0)
    assert "restarting" not in result.stderr
    return params


def assert_same(params, reference):
    assert params.keys() == reference.keys()
    for k in reference:
        np.testing.assert_array_equal(params[k], reference[k], err_msg=k)


@pytest.mark.timeout(120)
def test_restarts_set_torchelastic_variables_and_a_fresh_rendezvous(tmp_path):
    result = launch(["--nproc-per-node", "2", "--max-restarts", "3", "--rdzv-id", "job7",
                     str(WORKERS / "fail_first_attempt.py"), str(tmp_path)])
    assert result.returncode == 0, result.stderr
    assert "rank 1 exited with code 3" in result.stderr
    assert "restart 1 of --max-restarts 3" in result.stderr
    envs = [json.loads(line.split("ENV ", 1)[1]) for line in result.stdout.splitlines()
            if "ENV " in line]
    by_attempt = {a: [e for e in envs if e["TORCHELASTIC_RESTART_COUNT"] == a] for a in "01"}
    assert len(envs) == 4 and all(len(v) == 2 for v in by_attempt.values())  # no third attempt
    for e in envs:
        assert e["TORCHELASTIC_MAX_RESTARTS"] == "3" and e["TORCHELASTIC_RUN_ID"] == "job7"
        assert (e["GROUP_RANK"], e["GROUP_WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == ("0", "1", "2")
        assert e["JAXPG_COORDINATOR_HOSTED"] == f"{e['MASTER_ADDR']}:{e['MASTER_PORT']}"
    ports = [{e["MASTER_PORT"] for e in by_attempt[a]} for a in "01"]
    assert len(ports[0]) == len(ports[1]) == 1 and ports[0] != ports[1]  # a fresh coordinator


@pytest.mark.timeout(60)
def test_without_restarts_the_failure_ends_the_run(tmp_path):
    result = launch(["--nproc-per-node", "2", str(WORKERS / "fail_first_attempt.py"),
                     str(tmp_path)])
    assert result.returncode == 3
    assert "restarting" not in result.stderr


CPP_ABORTS = ("Terminating process because", "Check failure stack trace", "terminate called")
# One launch, one fault per attempt: attempt i resumes from what attempt i - 1 left.
CHAIN = ("raise:1:2",       # a rank raises and exits while the other waits in a barrier
         "ckpt:0:3",        # rank 0 dies while committing a checkpoint
         "stop:0:3",        # SIGSTOPped rank 0 (it holds no coordinator under jaxpg-run)
         "killduring:0:4",  # rank 0 dies inside a step's collectives
         "kill:1:5",        # rank 1 killed right after a step's checkpoint
         "ackpt:0:7",       # rank 0 dies in an asynchronous checkpoint's background commit
         "random:2026",     # a kill at a random rank and step, before that step's checkpoint
         "damage:1:7")      # a cut newest checkpoint (the seed above resumes at step 7)


def _attempts(stderr: str, restarts: int) -> list[str]:
    """The launcher's stderr cut at its restart lines: what each attempt ended with."""
    parts = re.split(r"\[jaxpg-run\] restarting the whole group .*\n", stderr)
    assert len(parts) == restarts + 1, stderr[-3000:]
    for k in range(1, restarts + 1):
        assert f"(restart {k} of --max-restarts {restarts})" in stderr
    return parts


def _rank0_attempts(stdout: str) -> list[str]:
    """Rank 0's output cut at its RESUMED lines: what each attempt printed."""
    lines = [line for line in stdout.splitlines() if line.startswith("[rank 0] ")]
    starts = [i for i, line in enumerate(lines) if "RESUMED step=" in line] + [len(lines)]
    return ["\n".join(lines[a:b]) for a, b in zip(starts, starts[1:])]


@pytest.mark.timeout(600)
def test_chained_faults_each_resume_to_the_uninterrupted_parameters(tmp_path, reference):
    result, params = train(tmp_path, "chain", ",".join(CHAIN), restarts=len(CHAIN),
                           timeout=540, FAULT_GROUP_TIMEOUT="6")
    everything = result.stdout + result.stderr
    assert not any(text in everything for text in CPP_ABORTS), everything[-3000:]
    ended = _attempts(result.stderr, len(CHAIN))
    resumed = {int(a): int(s) for s, a in
               re.findall(r"\[rank 0\] RESUMED step=(\d+) attempt=(\d+)", result.stdout)}
    assert sorted(resumed) == list(range(len(CHAIN) + 1)), result.stdout[-3000:]
    # raise:1:2: named first, or listed if rank 0's own error exit was seen in the same poll,
    # or (a loaded machine, where rank 1's exit outlasts rank 0's finding it lost) named by
    # rank 0's error, which the launcher quotes
    assert "RuntimeError: rank 1 fails at step 2" in ended[0]
    assert re.search(r"rank 1 (exited )?with code 1|\[jaxpg-run\] rank 0: DistNetworkError: "
                     r"barrier #\d+ on group 'WORLD': lost ranks \[1\]", ended[0]), \
        ended[0][-2000:]
    assert resumed[1] == 2
    # ckpt:0:3: the last complete checkpoint, not the partial 3
    assert "dying while committing checkpoint 3" in result.stdout
    assert "rank 0 exited with code -9 (killed by SIGKILL)" in ended[1]
    assert resumed[2] == 2
    # stop:0:3: rank 1 waits in the barrier for the group timeout and names the stopped rank 0
    assert re.search(r"DistTimeoutError: barrier #\d+ on group 'WORLD' did not finish "
                     r"within 6\.0 s: rank 0 .*ranks that did not arrive: \[0\]", ended[2])
    assert "rank 1 exited with code 1" in ended[2]
    assert resumed[3] == 3
    # killduring:0:4: died in step 4's update or its checkpoint
    assert "rank 0 exited with code -9 (killed by SIGKILL)" in ended[3]
    assert resumed[4] in (4, 5)
    # kill:1:5: right after step 5's checkpoint
    assert "rank 1 exited with code -9 (killed by SIGKILL)" in ended[4]
    assert resumed[5] == 6
    # ackpt:0:7: asynchronous checkpoints; the save of checkpoint 7 had returned (its loss
    # line printed) before its background commit killed rank 0, and 7 was never committed
    printed = _rank0_attempts(result.stdout)
    assert "dying while committing checkpoint 7" in printed[5], printed[5][-3000:]
    assert "[rank 0] step 6 loss" in printed[5]
    assert "rank 0 exited with code -9 (killed by SIGKILL)" in ended[5]
    assert resumed[6] == 6
    # random:2026: the killed step's checkpoint was never written
    drawn = re.search(r"FAULT killmid rank (\d) step (\d)", result.stdout)
    assert drawn, result.stdout[-3000:]
    rank, step = int(drawn.group(1)), int(drawn.group(2))
    assert f"rank {rank} exited with code -9" in ended[6] and 6 <= step < STEPS
    assert resumed[7] == step
    # damage:1:7: the restart skips checkpoint 8's cut files, with one warning per rank
    # naming it, and resumes from the one before
    assert "[rank 1] damaged checkpoint 8, dying" in result.stdout
    assert "rank 1 exited with code -9 (killed by SIGKILL)" in ended[7]
    assert ended[8].count("skipping the damaged checkpoint") == 2, ended[8][-3000:]
    assert "(step=8: array file state/" in ended[8]
    assert resumed[8] == 7
    assert "Traceback" not in ended[8] and "Event loop is closed" not in ended[7] + ended[8]
    assert_same(params, reference)


def _kill_rank_when(launcher: subprocess.Popen, lines: list[str], marker: str, rank: str):
    """Kills the launcher's worker with RANK=rank once ``marker`` appears in ``lines``."""
    while launcher.poll() is None:
        if any(marker in line for line in lines):
            children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text()
            for pid in children.split():
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                if f"RANK={rank}".encode() in environ:
                    os.kill(int(pid), signal.SIGKILL)
                    return
        time.sleep(0.05)


def _digits(args: list[str], checkpoint_dir: Path, kill: bool) -> tuple[int, str, str]:
    command = [sys.executable, "-m", "jaxpg.run", *args, str(EXAMPLE), "--epochs", "2",
               "--hidden", "32", "--checkpoint-dir", str(checkpoint_dir)]
    lines: list[str] = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=_env()) as launcher:
        err: list[str] = []
        reader = threading.Thread(target=lambda: err.extend(launcher.stderr), daemon=True)
        reader.start()
        killer = None
        if kill:
            killer = threading.Thread(target=_kill_rank_when,
                                      args=(launcher, lines, "epoch   1  loss", "1"), daemon=True)
            killer.start()
        try:
            for line in launcher.stdout:
                lines.append(line)
            launcher.wait(timeout=200)
        finally:
            launcher.kill()
        reader.join(timeout=10)
    return launcher.returncode, "".join(lines), "".join(err)


@pytest.mark.timeout(400)
def test_ddp_digits_resumes_from_its_checkpoint_dir_under_restarts(tmp_path):
    rc, plain, _ = _digits(["--nproc-per-node", "2"], tmp_path / "plain", kill=False)
    assert rc == 0, plain[-2000:]
    rc, out, err = _digits(["--nproc-per-node", "2", "--max-restarts", "1", "--grace-period",
                            "2"], tmp_path / "killed", kill=True)
    assert rc == 0, out[-2000:] + err[-2000:]
    assert "rank 1 exited with code -9" in err and "restart 1 of --max-restarts 1" in err
    assert "resumed from" in out

    def final(text: str) -> list[str]:
        return [re.sub(r"\(.*\)", "", line).strip() for line in text.splitlines()
                if "epoch   2" in line or "test accuracy" in line]

    assert final(out) == final(plain) and len(final(plain)) == 2
