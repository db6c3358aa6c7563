"""The recipe across processes: ``jaxpg-run --nproc-per-node 2 --devices-per-proc 4 -m
jaxpg.train`` trains the tiny Llama with FSDP x TP x CP (2 x 2 x 2 over the 8 devices of
both processes, each process feeding its data-parallel rank's sequences) to one-device
training's losses, gradient norms and eval losses; process 0 alone writes the JSONL, and
both processes write the (asynchronous) checkpoints."""

import json
import subprocess
import sys

import pytest
from _child_env import child_env
from test_recipe import BATCH, CONFIG, SEQ, STEPS, assert_trains_as, one_device

from jaxpg.train import load_config


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_recipe_across_two_processes_trains_as_one_device(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(CONFIG.replace("CKPT", str(tmp_path / "ckpt"))
                    .replace("METRICS", str(tmp_path / "metrics"))
                    .replace("tensorboard = true", "tensorboard = false"))
    env = child_env()
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", "2", "--devices-per-proc",
           "4", "-m", "jaxpg.train", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=560, env=env)
    text = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, text
    assert "dp_shard 2 x cp 2 x tp 2" in text and "on 8 devices" in text, text
    records = [json.loads(line) for line in
               (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    # one writer: each step once
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and [r["step"] for r in evals] == [2, 4]
    want = one_device(load_config(path), dp=2)
    assert len(want) == STEPS
    assert_trains_as(steps, evals, want)
    for r in steps:
        assert r["tokens_per_s"] == pytest.approx(BATCH * SEQ / r["step_time_s"])
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["2", "4"]
    for rank in (0, 1):
        assert f"[rank {rank}] step 4: loss {steps[-1]['loss']:.4f}" in proc.stdout, text
