"""Named hangs inside jitted steps, the flight recorder's dumps and ``jaxpg-fr-trace``,
across 3 real processes (gloo), a group timeout of 4 s and no DETAIL mode (the calls that
differ run with the default signature check off, `JAXPG_DEBUG=OFF`).

Each scenario (``workers/hang_worker.py``) breaks its world, so each runs in fresh
processes. In each, every surviving rank must raise a jaxpg error naming rank 1, every live
rank must write a dump, and the analyzer must name rank 1 and the calls by the names the
user called.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _child_env import xla_flags
from _procs import finish

from jaxpg.internal import free_port
from jaxpg.supervision.fr_dump import read_dump
from jaxpg.supervision.fr_trace import analyze, load_dumps

WORKER = Path(__file__).parent / "workers" / "hang_worker.py"
WORLD = 3
pytestmark = pytest.mark.slow


def _start(scenario: str, dumps: Path) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for r in range(WORLD):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("JAXPG_", "TORCH_")) and k not in ("RANK", "WORLD_SIZE")}
        env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu",
                   XLA_FLAGS=xla_flags(1), RANK=str(r),
                   WORLD_SIZE=str(WORLD), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), TEST_TIMEOUT_S="4", JAXPG_FR_BUFFER_SIZE="64",
                   JAXPG_FR_DUMP_DIR=str(dumps))
        if scenario in ("uneven", "desync"):  # calls that differ: the default check would
            env["JAXPG_DEBUG"] = "OFF"        # refuse them at once; these name the hang
        procs.append(subprocess.Popen([sys.executable, str(WORKER), scenario], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


def _run(scenario: str, tmp_path: Path) -> tuple[dict[int, str], Path]:
    """Runs a scenario; returns each rank's output and the dump directory."""
    dumps = tmp_path / "dumps"
    procs = _start(scenario, dumps)
    faulty = scenario in ("stop", "kill")
    try:
        survivors = [p for r, p in enumerate(procs) if not (faulty and r == 1)]
        outs = dict(zip([r for r in range(WORLD) if not (faulty and r == 1)],
                        [text for _, text in finish(survivors, 180)]))
    finally:
        for p in procs:
            if p.poll() is None:  # SIGKILL ends a stopped process without letting it run:
                p.kill()          # a SIGCONT first would let its recorder write a dump
        for r, p in enumerate(procs):
            text, _ = p.communicate(timeout=30)
            if faulty and r == 1:
                outs[1] = text
    return outs, dumps


def _error(text: str, rank: int) -> str:
    m = re.search(rf"\[rank {rank}\] ERROR (Dist\w+: .*)", text)
    assert m, text[-3000:]
    return m.group(1)


def _check_dumps(dumps: Path, live: list[int]) -> None:
    assert sorted(p.name for p in dumps.iterdir()) == [f"jaxpg_fr_rank_{r}" for r in live]
    for r in live:
        dump = read_dump(str(dumps / f"jaxpg_fr_rank_{r}"))
        assert not dump.partial and dump.header["ranks"] == [r], dump.header
        assert dump.calls and all(c["group"] for c in dump.calls)


def _verdict(dumps: Path) -> dict:
    procs, problems = load_dumps([str(dumps)])
    assert not problems, problems
    return analyze(procs)


@pytest.mark.timeout(300)
def test_uneven_ddp_steps_name_the_rank_that_ran_out_of_data(tmp_path):
    outs, dumps = _run("uneven", tmp_path)
    errors = {r: _error(outs[r], r) for r in range(WORLD)}
    for err in errors.values():
        assert err.startswith("DistTimeoutError: DistributedDataParallel.train_step #"), err
        assert "rank 1 never started it (its last call: barrier #" in err, err
        assert "ranks that did not arrive: [1]" in err, err
        assert "ddp.join()" in err, err
    assert len(set(errors.values())) == 1, "\n".join(errors.values())  # the same for rank 1
    _check_dumps(dumps, [0, 1, 2])
    verdict = _verdict(dumps)
    assert verdict["verdict"] == "mismatch" and verdict["culprit_ranks"] == [1], verdict
    text = verdict["text"]
    assert re.search(r"rank 1 called barrier #\d+ .*hang_worker\.py:\d+, where ranks 0, 2 "
                     r"called DistributedDataParallel\.train_step #\d+", text), text
    assert "rank 0: 4; rank 1: 3; rank 2: 4" in text, text


@pytest.mark.timeout(300)
def test_a_rank_calling_another_collective_is_named_with_both_calls(tmp_path):
    outs, dumps = _run("desync", tmp_path)
    for r in range(WORLD):
        err = _error(outs[r], r)
        assert err.startswith("DistTimeoutError: all_reduce #2 on group"), err
        assert "rank 1 never started it (its last call: all_gather_into_tensor #2" in err, err
        assert "rank 1 is running all_gather_into_tensor(group='group1', seq=2, " \
               "x=float32[4])" in err, err
    assert "[rank 2] USR1 dumped: True" in outs[2], outs[2][-3000:]
    manual = read_dump(str(tmp_path / "manual_0"))
    assert manual.header["trigger"] == "dump_flight_recorder()" and not manual.partial
    assert [c["op"] for c in manual.calls] == ["all_reduce"]  # the one call made before it
    _check_dumps(dumps, [0, 1, 2])
    dump = read_dump(str(dumps / "jaxpg_fr_rank_1"))
    last = dump.calls[-1]
    assert (last["op"], last["inputs"], last["state"]) == (
        "all_gather_into_tensor", [["x", [4], "float32"]], "timed out"), last
    assert last["caller"]["file"].endswith("hang_worker.py")
    # the console script, as a user runs it
    out = subprocess.run([str(Path(sys.executable).parent / "jaxpg-fr-trace"), str(dumps)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert re.search(r"rank 1 called all_gather_into_tensor #2 \(x=float32\[4\]; timed out\) "
                     r"at .*hang_worker\.py:\d+, where ranks 0, 2 called all_reduce #2 "
                     r"\(x=float32\[4\]; args=ReduceOp.SUM; timed out\)", out.stdout), out.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario, fate", [("stop", "is stopped"), ("kill", "died")])
def test_a_rank_stopped_or_killed_inside_a_step_is_named(tmp_path, scenario, fate):
    outs, dumps = _run(scenario, tmp_path)
    assert "[rank 1] FAULT inside the step" in outs[1], outs[1][-3000:]
    for r in (0, 2):
        err = _error(outs[r], r)
        assert re.match(r"Dist\w+Error: spmd\(step\) #4 on group 'group1'", err), err
        assert f"rank 1 {fate}" in err or "lost ranks [1]" in err, err
    _check_dumps(dumps, [0, 2])
    verdict = _verdict(dumps)
    assert verdict["culprit_ranks"] == [1], verdict
    assert "rank 1 has no dump" in verdict["text"], verdict["text"]
    assert re.search(r"ranks 0, 2 started spmd\(step\) #4 on group 'group1'",
                     verdict["text"]), verdict["text"]


@pytest.mark.timeout(300)
def test_under_the_launcher_the_survivors_of_a_kill_dump_on_sigterm(tmp_path):
    dumps = tmp_path / "dumps"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAXPG_", "TORCH_")) and k not in ("RANK", "WORLD_SIZE")}
    env.update(JAX_PLATFORMS="cpu", JAXPG_FR_BUFFER_SIZE="64", JAXPG_FR_DUMP_DIR=str(dumps))
    run = subprocess.run([sys.executable, "-m", "jaxpg.run", "--nproc-per-node", str(WORLD),
                          str(WORKER), "kill"], env=env, capture_output=True, text=True,
                         timeout=240)
    assert "rank 1 exited with code -9 (killed by SIGKILL)" in run.stderr, run.stderr[-3000:]
    _check_dumps(dumps, [0, 2])  # the launcher stopped them with SIGTERM: each dumped first
    for r in (0, 2):
        header = read_dump(str(dumps / f"jaxpg_fr_rank_{r}")).header
        assert header["trigger"] == "SIGTERM (the job is being stopped)", header
    verdict = _verdict(dumps)
    assert verdict["culprit_ranks"] == [1] and "rank 1 has no dump" in verdict["text"]
