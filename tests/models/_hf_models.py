"""Tiny random Hugging Face models of the three families, made by ``transformers`` (the
reference of the interop tests), saved sharded, and their logits on fixed tokens."""

from __future__ import annotations

import numpy as np

FAMILIES = ("llama", "qwen3", "qwen3_moe")
TOKENS = np.random.default_rng(0).integers(0, 64, (4, 16))
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def hf_model(family: str):
    """A tiny random ``transformers`` model of ``family`` in eval mode (float32)."""
    import torch
    import transformers

    torch.manual_seed({"llama": 0, "qwen3": 1, "qwen3_moe": 2}[family])
    if family == "llama":
        config = transformers.LlamaConfig(
            **COMMON, intermediate_size=64, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
        model = transformers.LlamaForCausalLM(config)
    elif family == "qwen3":
        config = transformers.Qwen3Config(**COMMON, intermediate_size=64, head_dim=16,
                                          tie_word_embeddings=True)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.Qwen3MoeConfig(
            **COMMON, intermediate_size=64, moe_intermediate_size=16, head_dim=8,
            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[1])
        model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def logits_of(model, tokens=TOKENS) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def save(model, folder) -> None:
    """Sharded safetensors (small shards, so the index is written)."""
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="20KB")
