"""Transformer presets by name: Llama 3, Qwen 3, a DeepSeek-V3-like MoE, Megatron-LM's GPTs.

The sizes are the published configurations. ``deepseek-v3-like`` keeps DeepSeek-V3's layer
count, widths, experts (256 routed, top 8, one shared, the first 3 blocks dense) and
vocabulary, with grouped-query attention in place of multi-head latent attention. The ``gpt-*``
presets are the GPT models of Narayanan et al. 2021 (Megatron-LM, Table 1): GeLU MLP of
``4 x dim``, vocabulary 51,200 with the embedding tied to the output head, dropout, attention
scores kept in memory.

Example:
    >>> get_model("llama3-8b").kv_heads
    8
"""

from __future__ import annotations

from jaxpg.plan.spec import TransformerSpec

__all__ = ["MODELS", "available_models", "get_model"]


def _llama(name, layers, dim, heads, ffn):
    return TransformerSpec(name=name, layers=layers, dim=dim, heads=heads, kv_heads=8,
                           ffn=ffn, vocab=128256)


def _qwen3(name, layers, dim, heads, kv, ffn, tied=False, **moe):
    return TransformerSpec(name=name, layers=layers, dim=dim, heads=heads, kv_heads=kv,
                           head_dim=128, ffn=ffn, vocab=151936, tied_embeddings=tied, **moe)


def _gpt(name, layers, dim, heads):
    return TransformerSpec(name=name, layers=layers, dim=dim, heads=heads, ffn=4 * dim,
                           vocab=51200, mlp="gelu", dropout=True, flash_attention=False,
                           tied_embeddings=True)


MODELS: dict[str, TransformerSpec] = {s.name: s for s in (
    _llama("llama3-8b", 32, 4096, 32, 14336),
    _llama("llama3-70b", 80, 8192, 64, 28672),
    _llama("llama3-405b", 126, 16384, 128, 53248),
    _qwen3("qwen3-0.6b", 28, 1024, 16, 8, 3072, tied=True),
    _qwen3("qwen3-1.7b", 28, 2048, 16, 8, 6144, tied=True),
    _qwen3("qwen3-4b", 36, 2560, 32, 8, 9728, tied=True),
    _qwen3("qwen3-8b", 36, 4096, 32, 8, 12288),
    _qwen3("qwen3-14b", 40, 5120, 40, 8, 17408),
    _qwen3("qwen3-32b", 64, 5120, 64, 8, 25600),
    _qwen3("qwen3-30b-a3b", 48, 2048, 32, 4, 6144, experts=128, top_k=8, expert_ffn=768),
    _qwen3("qwen3-235b-a22b", 94, 4096, 64, 4, 12288, experts=128, top_k=8,
           expert_ffn=1536),
    TransformerSpec(name="deepseek-v3-like", layers=61, dim=7168, heads=128, kv_heads=8,
                    head_dim=128, ffn=18432, vocab=129280, experts=256, top_k=8,
                    expert_ffn=2048, shared_experts=1, dense_layers=3),
    # Megatron-LM's Table 1 (Narayanan et al. 2021)
    _gpt("gpt-1.7b", 24, 2304, 24),
    _gpt("gpt-3.6b", 30, 3072, 32),
    _gpt("gpt-7.5b", 36, 4096, 32),
    _gpt("gpt-18b", 40, 6144, 48),
    _gpt("gpt-39b", 48, 8192, 64),
    _gpt("gpt-76b", 60, 10240, 80),
    _gpt("gpt-146b", 80, 12288, 96),
    _gpt("gpt-310b", 96, 16384, 128),
    _gpt("gpt-530b", 105, 20480, 128),
    _gpt("gpt-1t", 128, 25600, 160),
)}
"""Every preset, by name."""


def available_models() -> tuple[str, ...]:
    """The preset names :func:`get_model` knows."""
    return tuple(MODELS)


def get_model(name: str) -> TransformerSpec:
    """The preset called ``name``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name not in MODELS:
        raise ValueError(f"Unknown model preset {name!r}; choose one of {available_models()} "
                         "or give the sizes (--layers --dim --heads --ffn --vocab).")
    return MODELS[name]
