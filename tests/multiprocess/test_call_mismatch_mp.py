"""Errors that name the real cause (without JAXPG_DEBUG=DETAIL), two processes:

* the default signature check: calls that differ across the ranks (shapes 3 against 4 and 4
  against 8, dtypes, reduce ops, a cached call against a new one, recorded steps of other
  names or shapes) raise ``DistDesyncError`` on both ranks naming both calls, and none
  runs; the calls that agree in between give the right sums; a recorded step whose peer
  leaves while it waits raises a jaxpg error naming the peer;
* with the check off (``JAXPG_DEBUG=OFF``), an all_reduce whose shapes differ across ranks,
  then a barrier: every rank's timeout leads with the mismatch, both shapes named;
* ``save_checkpoint`` on rank 0 only, ``barrier()`` on rank 1: both raise within the
  timeout; rank 0's error names rank 1 as the rank that did not call it, and rank 1's
  barrier does not complete against the checkpoint's internal sync;
* then ``new_group`` on rank 0 only (in the same run): its store barrier raises
  ``DistTimeoutError`` within the group's timeout, naming rank 1 (docs/design.md).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "workers" / "call_mismatch_worker.py"
pytestmark = pytest.mark.slow


def _launch(case: str, tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "JAXPG_DEBUG", "TORCH_DISTRIBUTED_DEBUG")}
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", JAXPG_TEST_CASE=case, **extra)
    cmd = [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", "2", str(WORKER),
           str(tmp_path), "8"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env)


def _errors(case: str, tmp_path: Path, **extra: str) -> dict[int | str, str]:
    proc = _launch(case, tmp_path, **extra)
    found = dict(re.findall(r"\[rank (\d)\] (ERROR .*|NO ERROR)", proc.stdout))
    assert sorted(found) == ["0", "1"], proc.stdout[-4000:] + proc.stderr[-2000:]
    errors: dict[int | str, str] = {int(r): text for r, text in found.items()}
    for text in re.findall(r"\[rank 0\] NEW_GROUP (.*)", proc.stdout):
        errors["new_group"] = text
    return errors


def _call(fn: str, seq: int, inputs: str, args: str | None = "ReduceOp.SUM") -> str:
    tail = f", args={args}" if args else ""
    return f"{fn}(group='WORLD', seq={seq}, {inputs}{tail})"


# case -> (seq, rank 0's call, rank 1's call): each must raise DistDesyncError on both
MISMATCHES = {
    "shape_3_4": (1, "x=float32[3]", "x=float32[4]"),
    "shape_4_8": (2, "x=float32[4]", "x=float32[8]"),
    "dtype": (3, "x=float32[4]", "x=int32[4]"),
    "op": (4, "x=float32[4]", ("x=float32[4]", "ReduceOp.MAX")),
    "cache_hit": (6, "x=float32[5]", "x=float32[6]"),
}
RESULTS = {"warm": [3.0] * 5, "after": [3.0, 3.0], "step_warm": [3.0, 3.0],
           "step_after": [3.0, 3.0]}


@pytest.mark.timeout(240)
def test_calls_that_differ_raise_desync_on_every_rank_and_run_nowhere(tmp_path):
    proc = _launch("desync", tmp_path)
    out = proc.stdout
    cases: dict[tuple[int, str], str] = {}
    for r, name, text in re.findall(r"\[rank (\d)\] CASE (\w+) (.*)", out):
        cases[(int(r), name)] = text
    log = out[-6000:] + proc.stderr[-2000:]
    for rank in (0, 1):
        for name, (seq, mine, theirs) in MISMATCHES.items():
            text = cases.get((rank, name), "")
            assert text.startswith(f"ERROR DistDesyncError: all_reduce #{seq} on group "
                                   "'WORLD': the ranks called different collectives"), log
            if isinstance(theirs, tuple):
                theirs = _call("all_reduce", seq, *theirs)
            else:
                theirs = _call("all_reduce", seq, theirs)
            assert f"rank 0 (and every rank not named) is running " \
                   f"{_call('all_reduce', seq, mine)}; rank 1 is running {theirs}." in text, text
        for name, want in RESULTS.items():  # the calls that agree still run, and right
            assert cases.get((rank, name)) == f"RESULT {want}", log
        step = cases.get((rank, "step_name"), "")
        assert step.startswith("ERROR DistDesyncError: "), log
        assert ("rank 0 (and every rank not named) is running train_step(group='WORLD', "
                "seq=9, arg0=float32[4]); rank 1 is running eval_step(group='WORLD', seq=9, "
                "arg0=float32[4])") in step, step
        shapes = cases.get((rank, "step_shapes"), "")
        assert shapes.startswith("ERROR DistDesyncError: train_step #10 on group 'WORLD'"), log
        assert "rank 1 is running train_step(group='WORLD', seq=10, arg0=float32[6])" in shapes
    # rank 1 left while rank 0 waited in the step: a jaxpg error naming it, not XLA's
    lost = cases.get((0, "gloo_failure"), "")
    assert re.match(r"ERROR (DistNetworkError|DistTimeoutError): train_step #12 on group "
                    r"'WORLD'", lost), log
    assert "rank 1 died" in lost or "lost ranks [1]" in lost, lost


@pytest.mark.timeout(240)
def test_with_the_check_off_a_shape_mismatch_is_named_as_the_cause_on_every_rank(tmp_path):
    errors = _errors("shapes", tmp_path, JAXPG_DEBUG="OFF")
    for text in errors.values():
        assert text.startswith("ERROR DistTimeoutError: "), text
        assert "different shapes or arguments (the cause" in text, text
        assert "x=float32[3]" in text and "x=float32[4]" in text, text
        assert "left the job" not in text and "died" not in text, text


@pytest.mark.timeout(240)
def test_checkpoint_on_one_rank_raises_on_both_naming_the_other(tmp_path):
    errors = _errors("checkpoint", tmp_path)
    assert errors[0].startswith("ERROR DistTimeoutError: save_checkpoint #1 on group 'WORLD': "
                                "ranks [1] did not call save_checkpoint"), errors[0]
    assert errors[1].startswith("ERROR DistTimeoutError: barrier #"), errors[1]
    assert "rank 0 never started it" in errors[1], errors[1]
    # rank 0 alone creates a group: the creation barrier names rank 1 after the 2 s timeout
    assert re.fullmatch(r"ERROR DistTimeoutError: new_group '\w+' \(store barrier 'created'\): "
                        r"1 of 2 processes arrived within 2\.0 s; ranks that did not arrive: "
                        r"\[1\] \(processes \[1\]\)\. .*", errors.get("new_group", "")), errors
