"""Rotary position embeddings from each token's global position, with Llama 3's scaling.

The frequencies follow Hugging Face's ``rope_type`` ``"default"`` and ``"llama3"`` in
float32, and the rotation is its ``rotate_half`` form (the halves of each head, not
interleaved pairs), so checkpoints load without permuting the query and key weights.
Positions are an input, never ``arange`` inside the model: under context parallelism a
rank's tokens sit at the global positions its shard holds.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpg.models.config import ModelConfig

__all__ = ["inverse_frequencies", "rope_tables", "apply_rope"]


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """``(head_dim // 2,)`` float32 inverse frequencies, scaled as the config says."""
    dim = config.head_dim
    inv = (1.0 / (np.float32(config.rope_theta)
                  ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)))
    inv = inv.astype(np.float32)
    scaling = config.rope_scaling
    if scaling is None:
        return inv
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = ((old / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)`` of shape ``positions.shape + (head_dim,)``, float32."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates ``x`` ``(batch, seq, heads, head_dim)`` by tables ``(batch, seq, head_dim)``."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin
