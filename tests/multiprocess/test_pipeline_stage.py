"""torch's PipelineStage and schedule classes across 2 processes (one launch runs them all).

* torch's pipelining tutorial model (embedding + blocks + norm + head, 2 unequal stages):
  jaxpg's ``Schedule1F1B`` and ``ScheduleGPipe`` give torch pipelining's per-microbatch
  losses and every parameter gradient on the same weights and data (1e-5), including
  torch's accumulation without ``zero_grad`` (its ``scale_grads`` rule) and a step after
  an SGD update (3.11 leg, where torch is installed);
* every schedule class gives the un-pipelined model's losses and gradients, with stages of
  different shapes (both legs).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _procs import finish

from jaxpg.rendezvous import free_port

WORKER = Path(__file__).parent / "workers" / "pipeline_stage_worker.py"
CLASSES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
           "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble")


def _close(got, want, what, tol=1e-5):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale, err_msg=what)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_stage")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    port, torch_port = free_port(), free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), "2", str(port),
                               str(torch_port), str(out)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for r in range(2)]  # fmt: skip
    runs = finish(procs, timeout=360)
    for rc, text in runs:
        assert rc == 0 and "DONE" in text, text[-5000:]
    return [dict(np.load(out / f"rank{r}.npz")) for r in range(2)]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_tutorial_model_matches_torch_pipelining(results):
    pytest.importorskip("torch")
    for r, got in enumerate(results):
        torch_keys = [k for k in got if k.startswith("torch/")]
        assert torch_keys, f"rank {r} ran no torch pipeline"
        for key in torch_keys:
            mine = "jax/" + key[len("torch/"):]
            assert mine in got, f"rank {r}: jaxpg has no {mine}"
            _close(got[mine], got[key], f"rank {r}: {key}")
        grads = [k for k in torch_keys if "/grad" in k]
        assert len(grads) >= 8, grads  # every parameter of the stage, every step
    last = results[1]
    assert last["jax/1f1b/losses1"].shape == (4,)
    # the third step (after an SGD update) has lower losses: the stage trained
    assert last["jax/1f1b/losses3"].mean() < last["jax/1f1b/losses1"].mean()
    # without zero_grad the second step's gradients are torch's (g1 + g2) / m, not g2
    assert not np.allclose(last["jax/1f1b/grad2/output.weight"],
                           last["jax/1f1b/grad1/output.weight"])


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", CLASSES)
def test_every_schedule_class_gives_the_un_pipelined_gradients(results, name):
    ref_losses = results[0]["hetero/ref/losses"]
    _close(results[1][f"hetero/{name}/losses"], ref_losses, f"{name} losses")
    seen = 0
    for got in results:
        for key, value in got.items():
            if key.startswith(f"hetero/{name}/piece"):
                ref = results[0]["hetero/ref/" + key[len(f"hetero/{name}/"):]]
                _close(value, ref, key)
                seen += 1
    # pieces: embedding + block (7 arrays), 2 dense (2 each), head (4): all compared
    assert seen == 7 + 2 + 2 + 4, seen
