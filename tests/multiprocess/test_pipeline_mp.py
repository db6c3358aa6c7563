"""The pipeline's SPMD executor across 2 processes of one or two CPU devices each (ppermute
over gloo, inside and across the processes) computes the same loss and gradients as the same
pipeline on as many devices of one process, and as the un-pipelined model."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

WORKER = Path(__file__).parent / "workers" / "pipeline_worker.py"


def _worker_module():
    spec = importlib.util.spec_from_file_location("pipeline_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("devices_per_proc", [1, 2])
def test_two_process_pipeline_matches_one_process_and_un_pipelined(devices_per_proc, tmp_path):
    w = _worker_module()
    out = tmp_path / "grads.npz"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", "2", "--devices-per-proc",
           str(devices_per_proc), str(WORKER), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count("DONE") == 2
    got = dict(np.load(out))

    params, x, t = w.data()
    ref_loss, ref_grads = jax.value_and_grad(lambda p: w.mse(None, w.stage(p, x), t))(params)
    mesh = Mesh(np.array(jax.devices()[:2 * devices_per_proc]), ("pp",))
    for name in w.SCHEDULES:
        loss, grads = w.run(mesh, name)  # the same pipeline, one process, as many devices
        np.testing.assert_allclose(got[f"{name} loss"], loss, rtol=1e-6)
        np.testing.assert_allclose(got[f"{name} loss"], ref_loss, rtol=1e-5)
        for k, ref in ref_grads.items():
            one = np.asarray(grads[k]).reshape(ref.shape)
            np.testing.assert_allclose(got[f"{name} {k}"], one, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got[f"{name} {k}"], ref, rtol=1e-4, atol=1e-5)
