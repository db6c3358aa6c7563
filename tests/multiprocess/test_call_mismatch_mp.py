"""Errors that name the real cause (without JAXPG_DEBUG=DETAIL), two processes:

* an all_reduce whose shapes differ across ranks, then a barrier: every rank's error leads
  with the mismatch, both shapes named;
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


def _errors(case: str, tmp_path: Path) -> dict[int | str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", JAXPG_TEST_CASE=case)
    cmd = [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", "2", str(WORKER),
           str(tmp_path), "8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env)
    found = dict(re.findall(r"\[rank (\d)\] (ERROR .*|NO ERROR)", proc.stdout))
    assert sorted(found) == ["0", "1"], proc.stdout[-4000:] + proc.stderr[-2000:]
    errors: dict[int | str, str] = {int(r): text for r, text in found.items()}
    for text in re.findall(r"\[rank 0\] NEW_GROUP (.*)", proc.stdout):
        errors["new_group"] = text
    return errors


@pytest.mark.timeout(240)
def test_shape_mismatch_is_named_as_the_cause_on_every_rank(tmp_path):
    errors = _errors("shapes", tmp_path)
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
