"""The pipelined recipe from a TOML config: a tiny Llama of 4 layers over pp = 2 stages x
dp_replicate = 4 on 8 simulated devices (SGD) gives one-device training's losses,
gradient norms and eval losses on the whole batch; its metrics reach the terminal's bar,
the JSONL and a TensorBoard event file read back here; a resumed run continues to the
uninterrupted run's losses. Bad pipeline configs are refused by name."""

import json
import shutil

import numpy as np
import pytest
from test_recipe import BATCH, SEQ, assert_trains_as, one_device, read_scalars
from test_recipe import CONFIG as RECIPE_CONFIG

from jaxpg.train import config_from_dict, load_config, train

# the FSDP recipe's config with four layers and a pipeline [layout]
CONFIG = (RECIPE_CONFIG
          .replace("seed = 3\n", "seed = 3\noverrides = { num_layers = 4 }\n", 1)
          .replace("dp_shard = 2\ncp = 2\ntp = 2\n",
                   "pp = 2                  # 2 layers a stage\nmicrobatches = 2\n"
                   'schedule = "SCHEDULE"   # dp_replicate: the 4 devices left\n'))


def write_config(tmp_path, schedule="1f1b"):
    path = tmp_path / "run.toml"
    path.write_text(CONFIG.replace("CKPT", str(tmp_path / "ckpt"))
                    .replace("METRICS", str(tmp_path / "metrics"))
                    .replace("SCHEDULE", schedule))
    return load_config(path)


def test_pipelined_recipe_trains_as_one_device_logs_and_resumes(tmp_path, capsys):
    pytest.importorskip("tensorboardX", reason="the TensorBoard output needs tensorboardX")
    cfg = write_config(tmp_path)
    records = train(cfg)
    steps = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    want = one_device(cfg, dp=4)
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and [r["step"] for r in evals] == [2, 4]
    assert_trains_as(steps, evals, want, {"rtol": 1e-5}, {"rtol": 1e-5})
    assert want[3][0] < want[0][0] - 1e-2  # the steps trained
    for r in steps:
        assert r["lr"] >= 0 and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
        assert r["memory_bytes"] > 0
    err = capsys.readouterr().err  # the terminal: the bar with the metrics, the eval lines
    for key in ("loss=", "grad_norm=", "lr=", "tokens_per_s=", "mfu="):
        assert key in err
    assert "step 2 eval: loss=" in err and "4/4" in err
    assert "LlamaConfig on 8 devices, dp_replicate 4 x pp 2, 1f1b with 2 microbatches" in err
    lines = (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == records
    (event_file,) = (tmp_path / "metrics" / "tensorboard").glob("events.out.tfevents.*")
    scalars = read_scalars(event_file)
    for key in ("loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "mfu",
                "memory_bytes"):
        got = scalars[f"train/{key}"]
        assert [s for s, _ in got] == [1, 2, 3, 4]
        np.testing.assert_allclose([v for _, v in got], [r[key] for r in steps], rtol=1e-6)
    assert [s for s, _ in scalars["eval/loss"]] == [2, 4]

    # resume: drop the step-4 checkpoint; the run restores step 2 and redoes steps 3 and 4
    shutil.rmtree(tmp_path / "ckpt" / "4")
    again = [r for r in train(cfg) if r["kind"] == "train"]
    assert [r["step"] for r in again] == [3, 4]
    np.testing.assert_allclose([r["loss"] for r in again], [r["loss"] for r in steps[2:]],
                               rtol=1e-6)


def test_interleaved_pipeline_trains_as_one_device():
    # two chunks per rank: 4 stages of one layer on pp = 2
    cfg = config_from_dict({"steps": 2, "model": {"name": "llama3-tiny", "seed": 3,
                                                  "overrides": {"num_layers": 4}},
                            "layout": {"pp": 2, "microbatches": 2,
                                       "schedule": "interleaved_1f1b"},
                            "data": {"seq_len": SEQ, "global_batch": BATCH,
                                     "num_sequences": 32, "eval_sequences": 8, "seed": 5},
                            "optimizer": {"name": "sgd", "lr": 0.5, "schedule": "constant"},
                            "metrics": {"progress": False}})
    got = [r["loss"] for r in train(cfg) if r["kind"] == "train"]
    np.testing.assert_allclose(got, [w[0] for w in one_device(cfg, dp=4)], rtol=1e-5)


def pipelined(**layout):
    return {"model": {"name": "llama3-tiny", "overrides": {"num_layers": 4}},
            "layout": {"pp": 2, **layout}, "metrics": {"progress": False}}


def test_bad_pipeline_configs_name_the_key_and_the_fix():
    with pytest.raises(ValueError, match=r"layout.tp=2 with pp=2: .* set tp = 1, or pp = 1"):
        config_from_dict(pipelined(tp=2))
    with pytest.raises(ValueError, match=r"layout.cp=2 with pp=2"):
        config_from_dict(pipelined(cp=2))
    with pytest.raises(ValueError, match=r"layout.dp_shard=2 with pp=2: .* dp_replicate"):
        config_from_dict(pipelined(dp_shard=2))
    with pytest.raises(ValueError, match=r"layout.dp_replicate=2 .* needs pp > 1"):
        config_from_dict({"model": {"name": "llama3-tiny"}, "layout": {"dp_replicate": 2}})
    with pytest.raises(ValueError, match=r"num_layers=4 is not a multiple of pp x chunks"):
        train(config_from_dict(pipelined(pp=8)))  # 8 x 1 devices, 8 stages of 4 layers
    with pytest.raises(ValueError, match=r"pp x dp_replicate = 2 x 3 must equal the 8"):
        train(config_from_dict(pipelined(dp_replicate=3)))
    with pytest.raises(ValueError, match=r"global_batch=8 must be a multiple of "
                                         r"dp_replicate x microbatches = 4 x 4"):
        train(config_from_dict(pipelined(microbatches=4)))
    with pytest.raises(ValueError, match=r"Unknown schedule name='1f2b'"):
        train(config_from_dict(pipelined(schedule="1f2b")))
    with pytest.raises(ValueError, match=r"tie_word_embeddings = false"):
        train(config_from_dict({**pipelined(), "model": {"name": "qwen3-tiny",
                                                         "overrides": {"num_layers": 4}}}))
    with pytest.raises(ValueError, match=r"dense families .* set pp = 1"):
        train(config_from_dict({**pipelined(), "model": {"name": "qwen3-moe-tiny"}}))


def test_the_example_configs_are_valid():
    from pathlib import Path

    paths = sorted((Path(__file__).parents[2] / "examples" / "configs").glob("*.toml"))
    assert "llama_pipeline.toml" in [p.name for p in paths]
    for path in paths:
        cfg = load_config(path)
        assert cfg.steps >= 1
        if path.name == "llama_pipeline.toml":
            assert (cfg.layout.pp, cfg.layout.dp_replicate, cfg.layout.schedule) == (2, 4, "1f1b")
