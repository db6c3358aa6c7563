"""Context-parallel attention, and DDP with ``context_parallel=``, with one rank per
process: 4 real processes under jaxpg-run, one launch
(tests/context_parallel/workers/cp_worker.py)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from _child_env import child_env

WORKER = Path(__file__).parent / "workers" / "cp_worker.py"
CHECKS = {"every_method_fwd_and_grads_cp4", "every_method_fwd_and_grads_cp2",
          "host_call_own_shard_cp4", "uneven_shards_refused", "ddp_dp2_cp2_equals_one_device"}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_method_equals_full_attention_across_processes():
    env = child_env()
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", "4", str(WORKER)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=840, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    found: dict[int, set[str]] = {}
    for m in re.finditer(r"\[rank (\d+)\] CHECK (\w+) ok", proc.stdout):
        found.setdefault(int(m.group(1)), set()).add(m.group(2))
    assert found == {r: CHECKS for r in range(4)}, proc.stdout[-4000:]
