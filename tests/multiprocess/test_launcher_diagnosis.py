"""jaxpg-run explains a worker's C++ abort, or its jaxpg error, in one line after its output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxpg.run.diagnosis import diagnose

WORKERS = Path(__file__).parent / "workers"

GLOO_ABORT = """terminate called after throwing an instance of 'gloo::EnforceNotMet'
  what():  [enforce fail at external/gloo/gloo/transport/tcp/pair.cc:446] \
op.preamble.length <= op.nbytes. 8 vs 4
"""
FATAL = """F1125 09:57:12.214847    4340 client.h:80] Terminating process because the JAX \
distributed service detected fatal errors. This most likely indicates that another task died; \
see the other task logs for more details. absl::Status: UNAVAILABLE: Failed to send RPC
*** Check failure stack trace: ***
"""
REGISTER = FATAL.replace("UNAVAILABLE: Failed to send RPC",
                         "DEADLINE_EXCEEDED: Deadline Exceeded\n\nRPC: /xla.coordination."
                         "CoordinationService/RegisterTask")


@pytest.mark.parametrize("text, code, wanted", [
    (GLOO_ABORT, -6, "shapes differ across ranks (gloo received 8 bytes where this rank "
                     "expected 4): rerun with JAXPG_DEBUG=DETAIL"),
    (FATAL, -6, "coordination service reported a fatal error (UNAVAILABLE)"),
    (REGISTER, -6, "not every process joined within the initialization timeout"),
    ("terminate called after throwing an instance of 'std::bad_cast'\n  what():  "
     "std::bad_cast\n", -6, "the service reported a fatal error for it"),
    ("Traceback (most recent call last):\n  ...\njaxpg.errors.DistTimeoutError: all_reduce #3 on "
     "group 'WORLD' did not finish within 5.0 s; ranks that did not arrive: [1].\n", 1,
     "DistTimeoutError: all_reduce #3 on group 'WORLD'"),
    ("", -9, "out-of-memory killer"),
    ("ValueError: a user's own error\n", 1, None),
])
def test_known_endings_get_a_one_line_diagnosis(text, code, wanted):
    found = diagnose(text, code)
    if wanted is None:
        assert found is None
    else:
        assert found is not None and wanted in found and "\n" not in found


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_mismatched_shapes_abort_is_explained_after_the_workers_output():
    env = {k: v for k, v in os.environ.items() if k not in ("JAXPG_DEBUG",
                                                            "TORCH_DISTRIBUTED_DEBUG")}
    result = subprocess.run(
        [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", "2",
         str(WORKERS / "mismatched_shapes.py")],
        capture_output=True, text=True, timeout=120,
        env={**env, "JAX_PLATFORMS": "cpu", "JAXPG_DEBUG": "OFF"})  # else the check refuses
    assert result.returncode != 0, result.stdout + result.stderr[-3000:]
    err = result.stderr
    assert "[jaxpg-run] rank " in err, err[-3000:]
    tail = err[err.index("[jaxpg-run] rank "):]  # the diagnosis follows the workers' output
    assert "rerun with JAXPG_DEBUG=DETAIL" in tail, err[-3000:]
    assert "no error" not in result.stdout
