"""Hugging Face checkpoints across processes: 2 processes of 2 devices each load the three
families' tiny transformers models on dp_shard=2 x tp=2 (the MoE's experts also split
over ep=2) with transformers' logits, each reading its own blocks, and write them back;
the written checkpoints load into transformers with equal logits
(``workers/hf_worker.py``)."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _child_env import child_env
from _hf_models import FAMILIES, TOKENS, hf_model, logits_of, save
from _require import import_or_skip

WORKER = Path(__file__).parent / "workers" / "hf_worker.py"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_from_hf_and_to_hf_across_two_processes(tmp_path):
    transformers = import_or_skip("transformers", "the interop tests compare against it")
    np.save(tmp_path / "tokens.npy", TOKENS)
    for family in FAMILIES:
        model = hf_model(family)
        save(model, tmp_path / family)
        np.save(tmp_path / f"{family}_logits.npy", logits_of(model))
    env = child_env()
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", "2", "--devices-per-proc",
           "2", str(WORKER), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=560, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    want = {f"{f}_{c}" for f in FAMILIES for c in ("logits", "reads_its_share", "written")}
    for rank in (0, 1):
        found = set(re.findall(rf"\[rank {rank}\] CHECK (\w+) ok", proc.stdout))
        assert found == want, proc.stdout[-4000:]
    assert proc.stdout.count("DONE") == 2
    for family in FAMILIES:
        cls = getattr(transformers, type(hf_model(family)).__name__)
        back = cls.from_pretrained(str(tmp_path / "out" / family)).eval()
        np.testing.assert_allclose(logits_of(back), np.load(tmp_path / f"{family}_logits.npy"),
                                   rtol=0, atol=1e-4)
