"""Hang lines across 2 real processes (``jaxpg.supervision.hang_report``): while rank 1
sleeps before a collective, rank 0, waiting in it, prints every
``JAXPG_HANG_REPORT_SECONDS`` what it waits for; the call then finishes as usual. Under
gloo's blocking semantics (the caller waits) and under the accelerators' stream semantics
(the watchdog's thread watches the call; a private switch gives a CPU world those)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from _child_env import child_env

WORKER = Path(__file__).parent / "workers" / "hang_report_worker.py"
pytestmark = pytest.mark.slow
LINE = re.compile(r"\[rank 0\] \[jaxpg hang\] rank 0: all_reduce #(\d+) on group 'WORLD' has "
                  r"waited (\d+\.\d) s \(timeout 60\.0 s\): rank 1 never started it \(its last "
                  r"call: all_reduce #(\d+)[^)]*\); ranks that did not arrive: \[1\]\.")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("semantics", ["blocking", "stream"])
def test_a_waiting_rank_says_what_it_waits_for_every_n_seconds(semantics):
    env = child_env()
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", JAXPG_HANG_REPORT_SECONDS="1")
    if semantics == "stream":
        env["_JAXPG_STREAM_SEMANTICS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "jaxpg.run", "--nproc-per-node", "2",
                           str(WORKER), "5"], capture_output=True, text=True, timeout=120,
                          env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("RESULT [3.0, 3.0]") == 2 and out.count("DONE") == 2, out[-4000:]
    found = LINE.findall(out)
    assert len(found) >= 2, out[-4000:]
    waited = [float(w) for _, w, _ in found]
    assert 1.0 <= waited[0] < 2.5 and waited == sorted(waited), waited
    # every N seconds (the lines print tenths: 2.1 then 3.1 may be 0.95 s apart)
    assert all(w - v > 0.85 for v, w in zip(waited, waited[1:])), waited
    for seq, _, last in found:  # the call rank 0 waits in, and rank 1's call before it
        assert int(last) == int(seq) - 1, found
    assert "[rank 1] [jaxpg hang]" not in out  # the sleeping rank waits in no collective
    assert "DistTimeoutError" not in out
