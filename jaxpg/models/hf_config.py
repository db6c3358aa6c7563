"""Hugging Face's ``config.json`` to a family's config and back.

Reads both spellings Hugging Face has used: ``rope_theta`` with ``rope_scaling`` and the
newer ``rope_parameters``; ``num_experts`` and ``num_local_experts``. Writes the classic
keys, which every release reads. Anything the modules do not implement (another RoPE
type, biases, sliding windows, another activation) is refused by name.
"""

from __future__ import annotations

from typing import Any

from jaxpg.models.config import (
    Llama3RopeScaling,
    LlamaConfig,
    ModelConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

__all__ = ["config_from_hf", "config_to_hf"]

_FAMILIES = {"llama": (LlamaConfig, "LlamaForCausalLM"),
             "qwen3": (Qwen3Config, "Qwen3ForCausalLM"),
             "qwen3_moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM")}
API = "jaxpg.models.from_hf"


def _refuse(d: dict, key: str, allowed: Any, what: str) -> None:
    value = d.get(key, allowed)
    if value != allowed and value is not None:
        raise ValueError(f"{API}: config.json has {key}={value!r}; jaxpg.models implements "
                         f"{what} only ({key}={allowed!r}).")


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """The family config of a Hugging Face ``config.json`` dict.

    Raises:
        ValueError: an unknown ``model_type`` or a feature the modules lack.
    """
    model_type = d.get("model_type")
    if model_type not in _FAMILIES:
        raise ValueError(f"{API}: config.json's model_type={model_type!r} is not one of "
                         f"{sorted(_FAMILIES)}.")
    cls = _FAMILIES[model_type][0]
    _refuse(d, "hidden_act", "silu", "SwiGLU with silu")
    _refuse(d, "attention_bias", False, "attention without biases")
    _refuse(d, "mlp_bias", False, "MLPs without biases")
    _refuse(d, "use_sliding_window", False, "full (not sliding-window) attention")
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"{API}: config.json's RoPE type {rope_type!r} is not implemented; "
                         "jaxpg.models has 'default' and 'llama3'.")
    scaling = None
    if rope_type == "llama3":
        scaling = Llama3RopeScaling(
            factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    heads = d["num_attention_heads"]
    fields = dict(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
        num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim"), rope_theta=float(theta), rope_scaling=scaling,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=int(d.get("max_position_embeddings", 8192)))
    if cls is Qwen3MoeConfig:
        fields.update(
            num_experts=d.get("num_experts", d.get("num_local_experts")),
            num_experts_per_tok=d["num_experts_per_tok"],
            moe_intermediate_size=d["moe_intermediate_size"],
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(d.get("mlp_only_layers") or ()))
    return cls(**fields)


def config_to_hf(config: ModelConfig, dtype: str) -> dict[str, Any]:
    """A Hugging Face ``config.json`` dict for ``config`` (``dtype``: ``"float32"``, ...)."""
    model_type = config.family
    d: dict[str, Any] = {
        "architectures": [_FAMILIES[model_type][1]], "model_type": model_type,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "torch_dtype": dtype,
        "use_cache": True,
    }
    if model_type == "llama":
        d["mlp_bias"] = False
    else:
        d["use_sliding_window"] = False
    scaling = config.rope_scaling
    d["rope_scaling"] = None if scaling is None else {
        "rope_type": "llama3", "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings}
    if isinstance(config, Qwen3MoeConfig):
        d.update(num_experts=config.num_experts,
                 num_experts_per_tok=config.num_experts_per_tok,
                 moe_intermediate_size=config.moe_intermediate_size,
                 norm_topk_prob=config.norm_topk_prob,
                 decoder_sparse_step=config.decoder_sparse_step,
                 mlp_only_layers=list(config.mlp_only_layers))
    return d
