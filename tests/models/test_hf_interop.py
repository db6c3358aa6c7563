"""Hugging Face checkpoints in and out: tiny random ``transformers`` models of the three
families give the same logits (float32, <= 1e-4) loaded on one device and on dp_shard x tp
(and cp, ep) layouts of 8 simulated devices; written back from a sharded layout they load
into ``transformers`` with equal logits."""

import json
import os

import numpy as np
import pytest
from _hf_models import FAMILIES, TOKENS, hf_model, logits_of, save
from _require import import_or_skip

import jaxpg
from jaxpg import models

TOL = 1e-4
# per family: the layouts beside one device (8 ranks each); cp uses ring for Llama and the
# all-to-all (which repeats the one local K/V head to 2) for Qwen 3
LAYOUTS = {
    "llama": [dict(dp_shard=4, tp=2), dict(dp_shard=2, cp=2, tp=2)],
    "qwen3": [dict(dp_shard=4, tp=2), dict(dp_shard=2, cp=2, tp=2, method="all_to_all")],
    "qwen3_moe": [dict(dp_shard=4, tp=2, ep=4)],
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import_or_skip("transformers", "the Hugging Face interop tests compare against it")
    folder = tmp_path_factory.mktemp("hf")
    out = {}
    for family in FAMILIES:
        model = hf_model(family)
        save(model, folder / family)
        out[family] = (folder / family, logits_of(model))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_from_hf_gives_transformers_logits_and_to_hf_writes_them_back(
        family, checkpoints, tmp_path):
    import transformers

    path, want = checkpoints[family]
    assert os.path.exists(path / "model.safetensors.index.json")  # sharded input
    one = models.from_hf(str(path))
    assert one.layout is None
    np.testing.assert_allclose(np.asarray(one(TOKENS)), want, rtol=0, atol=TOL)
    for layout in LAYOUTS[family]:
        degrees = {k: v for k, v in layout.items() if k != "method"}
        dims = jaxpg.ParallelDims(**degrees)
        model = models.from_hf(str(path), dims=dims, cp_method=layout.get("method", "ring"))
        kernel = model.layers[0].self_attn.q_proj.kernel.get_value()
        assert kernel.sharding.spec == model.layout.spec("layers.0.self_attn.q_proj.kernel")
        assert "tp" in str(kernel.sharding.spec)  # split, not replicated
        np.testing.assert_allclose(np.asarray(model(TOKENS)), want, rtol=0, atol=TOL,
                                   err_msg=f"{family} {layout}")
    # written back from the last (sharded) layout, in small files with an index
    files = models.to_hf(model, str(tmp_path / "out"), max_shard_size="16KB")
    assert len(files) > 1
    with open(tmp_path / "out" / "model.safetensors.index.json") as f:
        assert set(json.load(f)["weight_map"].values()) == set(files)
    back = getattr(transformers, type(hf_model(family)).__name__).from_pretrained(
        str(tmp_path / "out"))
    np.testing.assert_allclose(logits_of(back.eval()), want, rtol=0, atol=TOL)
