"""The decoder's layers: RMSNorm, grouped-query attention, the SwiGLU MLP and its experts.

Attribute names follow Hugging Face's modules (``self_attn.q_proj``, ``mlp.gate_proj``,
``input_layernorm``), so a parameter's path is its checkpoint name without ``model.``.
Every shape is read from the array at hand: under tensor parallelism a rank's projections
give it its own heads, under sequence parallelism the column-parallel projections gather
the sequence, and the same code runs whole or split.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxpg.context_parallel import ContextParallelAttention
from jaxpg.expert_parallel import moe
from jaxpg.models.config import ModelConfig, Qwen3MoeConfig
from jaxpg.models.rope import apply_rope
from jaxpg.spmd_lowering import current_context

__all__ = ["RMSNorm", "Attention", "MLP", "MoE", "DecoderLayer", "swiglu"]

_INIT = nnx.initializers.normal(0.02)


class RMSNorm(nnx.Module):
    """``weight * x / sqrt(mean(x**2) + eps)``, normalised in float32."""

    def __init__(self, dim: int, eps: float, *, param_dtype: Any = jnp.float32):
        self.eps = float(eps)
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * h.astype(x.dtype)


def _linear(n_in: int, n_out: int, rngs: nnx.Rngs, dtype: Any, param_dtype: Any
            ) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                      kernel_init=_INIT, rngs=rngs)


class Attention(nnx.Module):
    """Causal grouped-query attention with RoPE (and Qwen 3's per-head q/k norms).

    The core is a :class:`~jaxpg.context_parallel.ContextParallelAttention`: plain
    attention with ``group=False``, ring or all-to-all attention over the cp group once the
    model is laid out with ``cp > 1``; K/V keep their ``num_kv_heads`` heads either way.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any):
        d, h, g, hd = (config.hidden_size, config.num_heads, config.num_kv_heads,
                       config.head_dim)
        self.head_dim = hd
        self.q_proj = _linear(d, h * hd, rngs, dtype, param_dtype)
        self.k_proj = _linear(d, g * hd, rngs, dtype, param_dtype)
        self.v_proj = _linear(d, g * hd, rngs, dtype, param_dtype)
        self.o_proj = _linear(h * hd, d, rngs, dtype, param_dtype)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps, param_dtype=param_dtype)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps, param_dtype=param_dtype)
        self.core = ContextParallelAttention(group=False, causal=True)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = (a.reshape(*a.shape[:2], -1, self.head_dim) for a in (q, k, v))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = self.core(q, k, v)
        return self.o_proj(o.reshape(*o.shape[:2], -1))


class MLP(nnx.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, d: int, f: int, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any):
        self.gate_proj = _linear(d, f, rngs, dtype, param_dtype)
        self.up_proj = _linear(d, f, rngs, dtype, param_dtype)
        self.down_proj = _linear(f, d, rngs, dtype, param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def swiglu(h: jax.Array) -> jax.Array:
    """The experts' activation on ``[gate | up]`` rows: ``silu(gate) * up``."""
    f = h.shape[-1] // 2
    return jax.nn.silu(h[..., :f]) * h[..., f:]


class MoE(nnx.Module):
    """Qwen3-MoE's sparse block through :func:`jaxpg.expert_parallel.moe` (dropless).

    Parameters: the router ``gate`` ``(d, E)``; the experts ``w1`` ``(E, d, 2f)`` (each
    expert's gate and up projections side by side) and ``w2`` ``(E, f, d)``. Qwen's
    ``norm_topk_prob`` renormalises the chosen probabilities, which equals the softmax of
    the chosen logits (``normalize_topk=True``). ``group`` is the expert-parallel group
    once the model is laid out with ``ep > 1`` (None: every expert on every rank).
    """

    def __init__(self, config: Qwen3MoeConfig, *, rngs: nnx.Rngs, dtype: Any,
                 param_dtype: Any):
        d, f, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
        self.top_k = config.num_experts_per_tok
        self.normalize = config.norm_topk_prob
        self.dtype = dtype
        self.group = None
        self.gate = nnx.Param(_INIT(rngs.params(), (d, e), param_dtype))
        self.w1 = nnx.Param(_INIT(rngs.params(), (e, d, 2 * f), param_dtype))
        self.w2 = nnx.Param(_INIT(rngs.params(), (e, f, d), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.group is None and current_context() is not None:
            raise ValueError(
                "MoE: the model runs in SPMD code (jaxpg.spmd, a DDP or FSDP step) but was "
                "not laid out, so its experts have no expert-parallel group; lay it out with "
                "jaxpg.models.parallelize(model, dims) first (ep=1 keeps every expert on "
                "every rank).")
        tokens = x.reshape(-1, x.shape[-1]).astype(self.dtype)
        y, _ = moe(tokens, self.gate[...].astype(self.dtype), self.w1[...].astype(self.dtype),
                   self.w2[...].astype(self.dtype), group=self.group, top_k=self.top_k,
                   activation=swiglu, normalize_topk=self.normalize)
        return y.reshape(x.shape)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: attention, then the MLP or the experts."""

    def __init__(self, config: ModelConfig, index: int, *, rngs: nnx.Rngs, dtype: Any,
                 param_dtype: Any):
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, param_dtype=param_dtype)
        self.self_attn = Attention(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps,
                                                param_dtype=param_dtype)
        if config.is_moe_layer(index):
            self.mlp = MoE(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, rngs=rngs,
                           dtype=dtype, param_dtype=param_dtype)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))
