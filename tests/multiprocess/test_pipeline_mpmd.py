"""The process executor (one pipeline rank per process) across 2 and 4 processes: the same
loss and gradients as the un-pipelined model and as the SPMD executor for every schedule
in both remat modes, a DP x PP train step, and named errors for a lost or stopped stage."""

from __future__ import annotations

import importlib.util
import re
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from _child_env import child_env
from jax.sharding import PartitionSpec as P

from jaxpg.internal import free_port

WORKER = Path(__file__).parent / "workers" / "pipeline_mpmd_worker.py"
CPP_ABORTS = ("Terminating process because", "Check failure stack trace", "terminate called",
              "exception not rethrown")


def _worker_module():
    spec = importlib.util.spec_from_file_location("pipeline_mpmd_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(world: int, case: str, out: Path, timeout: float, wait_for: int | None = None,
         **env_extra) -> list[tuple]:
    """Runs the worker on ``world`` ranks; returns each rank's (output, exit code). With
    ``wait_for=n`` only the first ``n`` ranks are awaited, and the rest (a stopped stage
    that never exits) are killed once those have ended."""
    env = child_env()
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **env_extra)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(port), case,
                               str(out)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for r in range(world)]  # fmt: skip
    outs = []
    try:
        for p in procs[:wait_for]:
            try:
                outs.append((p.communicate(timeout=timeout)[0], p.returncode))
            except subprocess.TimeoutExpired:
                p.kill()
                outs.append((p.communicate()[0] + "\n<killed: hung>", None))
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.communicate()  # closes its pipe (a no-op for the awaited ones)
    return outs


def _close(got, want, rtol=1e-5, what=""):
    """``|got - want| <= rtol * max |want|`` everywhere (float32 sums in another order)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * scale, err_msg=what)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 4])
def test_process_executor_matches_un_pipelined_and_spmd(world, tmp_path):
    w = _worker_module()
    out = tmp_path / "grads.npz"
    runs = _run(world, "grads", out, timeout=330)
    for text, rc in runs:
        assert rc == 0 and "DONE" in text, text[-4000:]
    got = dict(np.load(out))
    x, t = w.batch(w.M * w.ROWS)
    assert "dualpipe_v" in w.schedules(2) and "looped_bfs" in w.schedules(4)
    for name, v in w.schedules(world).items():
        params = w.model(world, v)
        ref_loss, ref = w.reference(params, x, t)
        spmd = f"{name} spmd remat=False"
        for remat in (False, True):
            tag = f"{name} mpmd remat={remat}"
            _close(got[f"{tag} loss"], ref_loss, what=tag)
            _close(got[f"{tag} first"], ref.first, what=tag)
            _close(got[f"{tag} last"], ref.last, what=tag)
            for k in ("w", "b"):
                _close(got[f"{tag} stages.{k}"], ref.stages[k], what=f"{tag} {k}")
            if world == 2:  # the lockstep executor on the same processes: the same numbers
                for k in ("w", "b"):
                    _close(got[f"{tag} stages.{k}"], got[f"{spmd} stages.{k}"], rtol=1e-6,
                           what=f"{tag} {k} vs spmd")
                _close(got[f"{tag} first"], got[f"{spmd} first"], rtol=1e-6,
                       what=f"{tag} first vs spmd")
                _close(got[f"{tag} loss"], got[f"{spmd} loss"], rtol=1e-6, what=tag)
        if world == 2:
            _close(got[f"{spmd} loss"], ref_loss, what=spmd)
    if world == 4:
        _check_training(w, got)


def _check_training(w, got):
    """Two SGD steps of the dp = 2 x pp = 2 pipeline equal one-device training on the whole
    batch (each replica's gradient averaged over dp, as DDP does)."""
    import optax

    params = w.model(2, 1, seed=2)
    optimizer = optax.sgd(0.1)
    state = optimizer.init(params)
    for i in range(2):
        x, t = w.batch(2 * w.M * w.ROWS, seed=10 + i)
        loss, grads = w.reference(params, x, t)
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        _close(got[f"train loss {i}"], loss, what=f"train loss {i}")
    for k in ("w", "b"):
        _close(got[f"train stages.{k}"], params.stages[k], what=f"train {k}")
    _close(got["train first"], params.first, what="train first")
    _close(got["train last"], params.last, what="train last")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case, env, error", [
    ("kill", {}, r"DistNetworkError: pipeline 1f1b \(process executor\).*lost ranks \[1\]"),
    ("stop", {"JAXPG_HEARTBEAT_TIMEOUT": "10"},  # docs/launcher.md: >= 10 s under load
     r"DistNetworkError: pipeline 1f1b \(process executor\).*lost ranks \[1\]"),
    ("timeout", {"JAXPG_HEARTBEAT_TIMEOUT": "60"},
     r"DistTimeoutError: pipeline 1f1b \(process executor\): rank 0 waited 3\.0 s for .* "
     r"from rank 1.*ranks that did not arrive: \[1\]"),
])  # fmt: skip
def test_a_lost_or_stopped_stage_is_a_named_error(case, env, error, tmp_path):
    (text, rc), = _run(2, case, tmp_path / "unused", timeout=120, wait_for=1, **env)
    assert "STEP OK 0" in text, text[-4000:]
    assert rc == 0 and re.search(error, text), text[-4000:]
    assert not any(a in text for a in CPP_ABORTS), text[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ranks_that_disagree_on_shapes_fail_at_the_metadata_exchange(tmp_path):
    runs = _run(2, "meta", tmp_path / "unused", timeout=120)
    for rank, (text, rc) in enumerate(runs):
        peer = 1 - rank
        assert rc == 0, text[-4000:]
        assert re.search(rf"CAUGHT ValueError: .*rank {rank} expects float32\[\d,8\] from rank "
                         rf"{peer}, but rank {peer} sends float32\[\d,8\]", text), text[-4000:]


def test_mpmd_needs_a_process_per_rank_and_host_code():
    from jax.sharding import Mesh

    from jaxpg.pipeline import pipeline_value_and_grad

    w = _worker_module()
    mesh = Mesh(np.array(jax.devices()[:2]), ("pp",))
    params = w.model(2, 1)
    x, t = w.batch(w.M * w.ROWS)
    kwargs = dict(mesh=mesh, schedule="1f1b", num_microbatches=w.M, first_fn=w.embed)
    with pytest.raises(ValueError, match="executor='mpmd' cannot run on this mesh: the job has "
                                         "one process"):
        pipeline_value_and_grad(w.block, w.head_loss, params, x, t, executor="mpmd", **kwargs)
    with pytest.raises(ValueError, match=r"executor='threads' is not one of \('auto', 'spmd', "
                                         r"'mpmd'\)"):
        pipeline_value_and_grad(w.block, w.head_loss, params, x, t, executor="threads",
                                **kwargs)  # fmt: skip
    with pytest.raises(ValueError, match="cannot be traced"):
        jax.jit(lambda p: pipeline_value_and_grad(w.block, w.head_loss, p, x, t,
                                                  executor="mpmd", **kwargs))(params)
    # tensor-parallel stages (another mesh axis, or param_specs) are the SPMD executor's
    mp_mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("pp", "mp"))
    with pytest.raises(ValueError, match=r"cannot run on this mesh: the mesh has axes \{'mp': 2\}"
                                         r" besides the pipeline"):
        pipeline_value_and_grad(w.block, w.head_loss, params, x, t, executor="mpmd",
                                **{**kwargs, "mesh": mp_mesh})
    with pytest.raises(ValueError, match="cannot run on this mesh: param_specs split"):
        pipeline_value_and_grad(w.block, w.head_loss, params, x, t, executor="mpmd",
                                param_specs=jax.tree.map(lambda _: P(), params), **kwargs)
