"""The training recipe from a TOML config: a tiny Llama with FSDP x TP x CP (2 x 2 x 2 on
8 simulated devices, SGD) gives one-device training's losses, gradient norms and eval
losses on the whole batch; its metrics reach the terminal, the JSONL and a TensorBoard
event file read back here; a resumed run continues to the uninterrupted run's losses."""

import json
import shutil
import struct

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpg import models
from jaxpg.train import load_config, train
from jaxpg.train.config import config_from_dict
from jaxpg.train.data import EVAL_SEED_OFFSET, StepBatches, synthetic_sequences
from jaxpg.train.recipe import choose_degrees, make_optimizer, model_config

STEPS, SEQ, BATCH = 4, 16, 8

CONFIG = f"""
steps = {STEPS}

[model]
name = "llama3-tiny"
seed = 3

[layout]
dp_shard = 2
cp = 2
tp = 2

[data]
seq_len = {SEQ}
global_batch = {BATCH}
num_sequences = 32
eval_sequences = 8
seed = 5

[optimizer]
name = "sgd"
lr = 0.5
schedule = "warmup_cosine"
warmup_steps = 1
end_lr = 0.05

[checkpoint]
dir = "CKPT"
every = 2
async_save = true

[eval]
every = 2
batches = 1

[metrics]
dir = "METRICS"
tensorboard = true
hardware = "h100-80gb"
"""


def one_device(cfg, dp=2):
    """SGD on one device over the same global batches (``dp`` data-parallel ranks'
    sequences): losses, gradient norms, and the held-out loss after each step."""
    config = model_config(cfg)
    graphdef, params = nnx.split(models.CausalLM(config, rngs=nnx.Rngs(cfg.model.seed)))
    tx, _ = make_optimizer(cfg)
    state = tx.init(params)
    d = cfg.data
    data = StepBatches(synthetic_sequences(d.num_sequences, d.seq_len + 1, config.vocab_size,
                                           d.seed),
                       global_batch=d.global_batch, dp=dp, ranks=list(range(dp)), seed=d.seed)
    held = synthetic_sequences(d.eval_sequences, d.seq_len + 1, config.vocab_size,
                               d.seed + EVAL_SEED_OFFSET)[:d.global_batch]

    def loss(p, b):
        logits = nnx.merge(graphdef, p)(b["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

    grad = jax.jit(jax.value_and_grad(loss))
    out = []
    for step in range(cfg.steps):
        value, g = grad(params, data.batch(step))
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
        ev = float(loss(params, {"tokens": held[:, :-1], "targets": held[:, 1:]}))
        out.append((float(value), float(optax.tree.norm(g)), ev))
    return out


def assert_trains_as(steps, evals, want, loss_tol=None, norm_tol=None):
    """The run's losses, gradient norms and eval losses (steps 2 and 4) against
    :func:`one_device`'s ``want``; tolerances as ``assert_allclose`` keywords."""
    loss_tol = loss_tol or {"rtol": 0, "atol": 2e-5}
    norm_tol = norm_tol or {"rtol": 1e-4, "atol": 1e-6}
    np.testing.assert_allclose([r["loss"] for r in steps], [w[0] for w in want], **loss_tol)
    np.testing.assert_allclose([r["grad_norm"] for r in steps], [w[1] for w in want],
                               **norm_tol)
    np.testing.assert_allclose([r["loss"] for r in evals], [want[1][2], want[3][2]],
                               **loss_tol)


def read_scalars(path):
    """``{tag: [(step, value)]}`` from a TensorBoard event file (TFRecord framing: length,
    its CRC, the serialized ``Event``, its CRC)."""
    from tensorboardX.proto import event_pb2

    scalars, data = {}, path.read_bytes()
    offset = 0
    while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset:offset + 8])
        event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
        offset += 12 + length + 4
        for value in event.summary.value:
            scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_recipe_trains_as_one_device_logs_everywhere_and_resumes(tmp_path, capsys):
    pytest.importorskip("tensorboardX", reason="the TensorBoard output needs tensorboardX")
    path = tmp_path / "run.toml"
    path.write_text(CONFIG.replace("CKPT", str(tmp_path / "ckpt"))
                    .replace("METRICS", str(tmp_path / "metrics")))
    cfg = load_config(path)
    records = train(cfg)
    steps = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    want = one_device(cfg)
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and [r["step"] for r in evals] == [2, 4]
    assert_trains_as(steps, evals, want)
    assert want[3][0] < want[0][0] - 1e-2  # the steps trained
    # the schedule: warmup from 0 over one step, then cosine from 0.5 to 0.05 at step 4
    np.testing.assert_allclose([r["lr"] for r in steps],
                               [0.0, 0.5, 0.05 + 0.45 * 0.5 * (1 + np.cos(np.pi / 3)),
                                0.05 + 0.45 * 0.5 * (1 + np.cos(np.pi * 2 / 3))], rtol=1e-5)
    # MFU from 6N + attention: N the matmul weights a token meets (the head included)
    c = models.config_for("llama3-tiny")
    hd = c.head_dim or c.hidden_size // c.num_heads
    per_layer = (c.hidden_size * hd * (2 * c.num_heads + 2 * c.num_kv_heads)
                 + 3 * c.hidden_size * c.intermediate_size)
    n = c.num_layers * per_layer + c.hidden_size * c.vocab_size
    flops = 6 * n + 3 * c.num_layers * 4 * SEQ * c.num_heads * hd
    for r in steps:
        assert r["tokens_per_s"] == pytest.approx(BATCH * SEQ / r["step_time_s"])
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops / (67e12 * 8))  # h100 fp32
        assert r["memory_bytes"] > 0 and r["memory_source"] in ("device", "host_rss")

    # the terminal: tqdm's bar with the metrics, and the eval lines
    err = capsys.readouterr().err
    for key in ("loss=", "grad_norm=", "lr=", "tokens_per_s=", "mfu="):
        assert key in err
    assert "step 2 eval: loss=" in err and "4/4" in err
    assert "LlamaConfig on 8 devices, dp_shard 2 x cp 2 x tp 2" in err
    # the JSONL holds the same records
    lines = (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == records
    # TensorBoard: one event file with every numeric metric, read back
    (event_file,) = (tmp_path / "metrics" / "tensorboard").glob("events.out.tfevents.*")
    scalars = read_scalars(event_file)
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "mfu", "memory_bytes"):
        got = scalars[f"train/{key}"]
        assert [s for s, _ in got] == [1, 2, 3, 4]
        np.testing.assert_allclose([v for _, v in got], [r[key] for r in steps], rtol=1e-6)
    assert [s for s, _ in scalars["eval/loss"]] == [2, 4]

    # resume: drop the step-4 checkpoint; the run restores step 2 and redoes steps 3 and 4
    shutil.rmtree(tmp_path / "ckpt" / "4")
    resumed = train(cfg)
    again = [r for r in resumed if r["kind"] == "train"]
    assert [r["step"] for r in again] == [3, 4]
    np.testing.assert_allclose([r["loss"] for r in again], [r["loss"] for r in steps[2:]],
                               rtol=0, atol=1e-6)


def test_bad_configs_name_the_key_and_the_fix():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['lrate'\] in \[optimizer\]"):
        config_from_dict({"model": {"name": "llama3-tiny"}, "optimizer": {"lrate": 1.0}})
    with pytest.raises(ValueError, match="checkpoint.every=5 needs checkpoint.dir"):
        config_from_dict({"model": {"name": "llama3-tiny"}, "checkpoint": {"every": 5}})
    with pytest.raises(ValueError, match=r"\[model\] table is missing"):
        config_from_dict({"steps": 3})
    cfg = config_from_dict({"model": {"name": "llama3-tiny"},
                            "layout": {"dp_shard": 2, "tp": 2}, "metrics": {"progress": False}})
    with pytest.raises(ValueError, match="must equal the 8 devices"):
        train(cfg)


def test_auto_layout_takes_the_planners_choice_of_the_devices():
    cfg = config_from_dict({"model": {"name": "llama3-tiny"}, "layout": {"auto": True},
                            "data": {"seq_len": 32, "global_batch": 8}})
    config = models.config_for("llama3-tiny")
    got = choose_degrees(cfg, config, 8)
    assert got["dp_shard"] * got["cp"] * got["tp"] == 8
    assert config.num_kv_heads % got["tp"] == 0 and 8 % got["dp_shard"] == 0
    with pytest.raises(ValueError, match="no dp_shard x cp x tp layout"):
        # one sequence of 3 tokens: no data parallelism, no cp (seq_len % 2cp), tp <= 2 (the
        # kv heads) and pp <= 2 (the layers) cannot make 8 devices
        choose_degrees(config_from_dict({"model": {"name": "llama3-tiny"},
                                         "layout": {"auto": True},
                                         "data": {"seq_len": 3, "global_batch": 1,
                                                  "num_sequences": 4}}), config, 8)
