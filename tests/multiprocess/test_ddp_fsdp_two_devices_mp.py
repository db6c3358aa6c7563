"""DDP, FSDP and tensor parallelism (tp inside and across processes) with 2 processes of 2
devices each (``--devices-per-proc 2``), against one-device training on the whole batch
(``workers/ddp_fsdp_two_devices_worker.py``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from _child_env import child_env

WORKER = Path(__file__).parent / "workers" / "ddp_fsdp_two_devices_worker.py"
pytestmark = pytest.mark.slow


@pytest.mark.timeout(400)
def test_ddp_fsdp_and_tp_with_two_devices_per_process():
    env = child_env()
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", "2", "--devices-per-proc",
           "2", str(WORKER)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=380, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for rank in (0, 1):
        found = set(re.findall(rf"\[rank {rank}\] CHECK (\w+) ok", proc.stdout))
        assert found == {"ddp_equals_reference", "fsdp_equals_reference",
                         "tp_in_process", "tp_across_processes"}, proc.stdout[-4000:]
    assert proc.stdout.count("DONE") == 2
