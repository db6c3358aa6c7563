"""The model families' configurations: Llama 3, Qwen 3 and Qwen3-MoE, with published sizes.

One frozen ``@dataclass(kw_only=True)`` per family (hashable, as a module's static
attribute must be for programs cached by the module's structure), validated in
``__post_init__``, holding what the modules and the planner need: widths, heads and
key/value heads, RoPE and its scaling, the experts. :data:`PRESETS` names the published
sizes (``"llama3-8b"``, ``"qwen3-30b-a3b"``, ...) and tiny ones for tests
(``"llama3-tiny"``, ...); :func:`config_for` returns a fresh copy by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

__all__ = ["Llama3RopeScaling", "ModelConfig", "LlamaConfig", "Qwen3Config", "Qwen3MoeConfig",
           "PRESETS", "config_for"]


@dataclasses.dataclass(kw_only=True, frozen=True)
class Llama3RopeScaling:
    """Llama 3's RoPE frequency scaling (``rope_type: "llama3"`` in Hugging Face's config).

    Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` keep
    their frequency, longer than ``... / low_freq_factor`` are divided by ``factor``, and
    those between are interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """A decoder-only transformer: RMSNorm, RoPE, grouped-query attention, SwiGLU.

    Args:
        vocab_size: tokens in the vocabulary.
        hidden_size: the model width.
        intermediate_size: the SwiGLU MLP's hidden width.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention); must divide ``num_heads``.
        head_dim: each head's width; None for ``hidden_size // num_heads``.
        rope_theta: RoPE's base.
        rope_scaling: Llama 3's frequency scaling, or None.
        rms_norm_eps: the RMSNorms' epsilon.
        tie_word_embeddings: the output head is the embedding table transposed.
        max_position_embeddings: the longest sequence the model was trained for.
    """

    family: ClassVar[str] = ""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        api = type(self).__name__
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{api}: {name}={value!r} must be an int >= 1.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{api}: num_kv_heads={self.num_kv_heads} must divide "
                             f"num_heads={self.num_heads} (each key/value head serves a "
                             "group of query heads).")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"{api}: hidden_size={self.hidden_size} is not divisible by "
                                 f"num_heads={self.num_heads}; pass head_dim=.")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise ValueError(f"{api}: head_dim={self.head_dim} must be even (RoPE rotates "
                             "pairs).")

    @property
    def qk_norm(self) -> bool:
        """Whether queries and keys pass a per-head RMSNorm before RoPE (Qwen 3)."""
        return False

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` has a mixture of experts instead of an MLP."""
        return False

    def num_params(self) -> int:
        """The parameter count (embeddings and head included)."""
        d, h, g, hd = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        attn = d * hd * (h + 2 * g) + h * hd * d + (2 * hd if self.qk_norm else 0)
        total = 0
        for i in range(self.num_layers):
            total += attn + 2 * d + self._mlp_params(i)
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return total + self.vocab_size * d + head + d

    def active_params(self) -> int:
        """Parameters a token meets (for MoE, only its ``top_k`` experts)."""
        return self.num_params()

    def _mlp_params(self, index: int) -> int:
        return 3 * self.hidden_size * self.intermediate_size


@dataclasses.dataclass(kw_only=True, frozen=True)
class LlamaConfig(ModelConfig):
    """Llama 3: grouped-query attention and RoPE with Llama 3's frequency scaling."""

    family: ClassVar[str] = "llama"


@dataclasses.dataclass(kw_only=True, frozen=True)
class Qwen3Config(ModelConfig):
    """Qwen 3: Llama's layout with a per-head RMSNorm on queries and keys."""

    family: ClassVar[str] = "qwen3"
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6

    @property
    def qk_norm(self) -> bool:
        return True


@dataclasses.dataclass(kw_only=True, frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3-MoE: Qwen 3 whose MLPs are mixtures of SwiGLU experts.

    Args:
        num_experts: experts per MoE layer.
        num_experts_per_tok: ``top_k``.
        moe_intermediate_size: each expert's hidden width.
        norm_topk_prob: the chosen experts' probabilities renormalised to sum to 1.
        decoder_sparse_step: every ``decoder_sparse_step``-th layer is an MoE layer.
        mlp_only_layers: layers that keep a dense MLP.
    """

    family: ClassVar[str] = "qwen3_moe"
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"Qwen3MoeConfig: num_experts_per_tok={self.num_experts_per_tok} "
                             f"must be between 1 and num_experts={self.num_experts}.")

    def is_moe_layer(self, index: int) -> bool:
        return (index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    def _mlp_params(self, index: int) -> int:
        if not self.is_moe_layer(index):
            return super()._mlp_params(index)
        d = self.hidden_size
        return d * self.num_experts + 3 * d * self.moe_intermediate_size * self.num_experts

    def active_params(self) -> int:
        d = self.hidden_size
        idle = self.num_experts - self.num_experts_per_tok
        moe_layers = sum(self.is_moe_layer(i) for i in range(self.num_layers))
        return self.num_params() - moe_layers * 3 * d * self.moe_intermediate_size * idle


_LLAMA31 = dict(vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
                rope_scaling=Llama3RopeScaling(), max_position_embeddings=131072)
_QWEN3 = dict(vocab_size=151936, head_dim=128, max_position_embeddings=40960)

PRESETS: dict[str, tuple[type[ModelConfig], dict[str, Any]]] = {
    "llama3-8b": (LlamaConfig, dict(_LLAMA31, hidden_size=4096, intermediate_size=14336,
                                    num_layers=32, num_heads=32, num_kv_heads=8)),
    "llama3-70b": (LlamaConfig, dict(_LLAMA31, hidden_size=8192, intermediate_size=28672,
                                     num_layers=80, num_heads=64, num_kv_heads=8)),
    "llama3-405b": (LlamaConfig, dict(_LLAMA31, hidden_size=16384, intermediate_size=53248,
                                      num_layers=126, num_heads=128, num_kv_heads=8)),
    "qwen3-0.6b": (Qwen3Config, dict(_QWEN3, hidden_size=1024, intermediate_size=3072,
                                     num_layers=28, num_heads=16, num_kv_heads=8,
                                     tie_word_embeddings=True)),
    "qwen3-1.7b": (Qwen3Config, dict(_QWEN3, hidden_size=2048, intermediate_size=6144,
                                     num_layers=28, num_heads=16, num_kv_heads=8,
                                     tie_word_embeddings=True)),
    "qwen3-4b": (Qwen3Config, dict(_QWEN3, hidden_size=2560, intermediate_size=9728,
                                   num_layers=36, num_heads=32, num_kv_heads=8,
                                   tie_word_embeddings=True)),
    "qwen3-8b": (Qwen3Config, dict(_QWEN3, hidden_size=4096, intermediate_size=12288,
                                   num_layers=36, num_heads=32, num_kv_heads=8)),
    "qwen3-14b": (Qwen3Config, dict(_QWEN3, hidden_size=5120, intermediate_size=17408,
                                    num_layers=40, num_heads=40, num_kv_heads=8)),
    "qwen3-32b": (Qwen3Config, dict(_QWEN3, hidden_size=5120, intermediate_size=25600,
                                    num_layers=64, num_heads=64, num_kv_heads=8)),
    "qwen3-30b-a3b": (Qwen3MoeConfig, dict(
        _QWEN3, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_layers=48, num_heads=32, num_kv_heads=4, num_experts=128, num_experts_per_tok=8)),
    "qwen3-235b-a22b": (Qwen3MoeConfig, dict(
        _QWEN3, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
        num_layers=94, num_heads=64, num_kv_heads=4, num_experts=128, num_experts_per_tok=8)),
    # tiny sizes for tests and examples: two layers, 4 query heads over 2 key/value heads
    "llama3-tiny": (LlamaConfig, dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, rope_theta=500000.0, max_position_embeddings=64,
        rope_scaling=Llama3RopeScaling(factor=8.0, original_max_position_embeddings=16))),
    "qwen3-tiny": (Qwen3Config, dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, tie_word_embeddings=True, max_position_embeddings=64)),
    "qwen3-moe-tiny": (Qwen3MoeConfig, dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64)),
}


def config_for(name: str, **overrides: Any) -> ModelConfig:
    """A fresh config of preset ``name``, with ``overrides`` replacing its fields.

    Raises:
        ValueError: for a name that is not in :data:`PRESETS`.
    """
    if name not in PRESETS:
        raise ValueError(f"config_for: no preset {name!r}; the presets are "
                         f"{sorted(PRESETS)}.")
    cls, fields = PRESETS[name]
    return cls(**{**fields, **overrides})
