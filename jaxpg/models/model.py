"""``CausalLM``: the decoder-only language model of every family, as an NNX module.

``CausalLM(config, rngs=...)`` builds Llama 3, Qwen 3 or Qwen3-MoE from its config;
``model(tokens, positions)`` gives the logits. Two ways to call it:

* **per rank** (inside ``jax.jit``, ``jaxpg.spmd``, a DDP/FSDP step): ``tokens`` are this
  rank's ``(batch, seq_local)`` and ``positions`` their *global* positions, which must be
  passed when the model is laid out with ``cp > 1`` (each rank holds a shard of the
  sequence, so ``arange`` would be wrong). Build the batch with a ``positions`` leaf of
  ``np.arange(seq)`` per sequence and let the data-parallel wrapper's
  ``context_parallel=`` split it with the tokens.
* **from host code** with concrete tokens: ``tokens`` are one global batch
  ``(batch, seq)`` (the same on every process), and the model runs one cached, jitted
  program over its layout's mesh (:mod:`jaxpg.models.host_forward`); the logits come back
  whole.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxpg.models.config import ModelConfig
from jaxpg.models.layers import DecoderLayer, RMSNorm
from jaxpg.models.rope import inverse_frequencies, rope_tables
from jaxpg.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
)

__all__ = ["CausalLM"]

API = "CausalLM"


class CausalLM(nnx.Module):
    """A decoder-only transformer with its output head.

    Args:
        config: a :class:`~jaxpg.models.LlamaConfig`, ``Qwen3Config`` or ``Qwen3MoeConfig``.
        rngs: ``nnx.Rngs`` for the random initial weights.
        dtype: the computation's dtype.
        param_dtype: the parameters' dtype.

    Example:
        >>> model = CausalLM(config_for("llama3-tiny"), rngs=nnx.Rngs(0))
        >>> logits = model(np.zeros((2, 8), np.int32))        # (2, 8, vocab)
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32,
                 param_dtype: Any = jnp.float32):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"{API}: config must be a ModelConfig (LlamaConfig, Qwen3Config, "
                            f"Qwen3MoeConfig); got {type(config).__name__}.")
        self.config = config
        self.dtype = dtype
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                                      param_dtype=param_dtype,
                                      embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, i, rngs=rngs, dtype=dtype,
                                             param_dtype=param_dtype)
                                for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=param_dtype)
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False,
                                      dtype=dtype, param_dtype=param_dtype,
                                      kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.layout = None  # set by jaxpg.models.parallelize / from_hf

    def __call__(self, tokens: Any, positions: Any = None) -> jax.Array:
        """Logits ``(batch, seq, vocab)`` of ``tokens`` (see the module's two forms)."""
        if not isinstance(tokens, jax.core.Tracer):
            from jaxpg.models.host_forward import host_logits

            return host_logits(self, tokens, positions)
        return self.forward(tokens, positions)

    def forward(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """The per-rank forward (traced code): this rank's tokens and global positions."""
        positions = self._positions(tokens, positions)
        h = self.embed_tokens(tokens)
        cos, sin = rope_tables(positions, inverse_frequencies(self.config))
        for layer in self.layers:
            h = layer(h, cos, sin)
        h = self.norm(h)
        if hasattr(self, "lm_head"):
            return self.lm_head(h)
        return self._tied_head(h)

    def _tied_head(self, h: jax.Array) -> jax.Array:
        """``h @ embedding.T``; with the table split over tp on the vocabulary, each rank
        computes its columns and the logits are gathered (Megatron's tied head)."""
        table = self.embed_tokens.embedding[...]
        layout = self.layout
        if layout is None or layout.tp == 1:
            return jnp.einsum("bsd,vd->bsv", h, table.astype(h.dtype))
        axis = layout.tp_axis
        if layout.sequence_parallel:  # the norm's output is this rank's sequence chunk
            h = gather_from_sequence_parallel_region(h, axis, dim=1)
        else:
            h = copy_to_tensor_parallel_region(h, axis)
        logits = jnp.einsum("bsd,vd->bsv", h, table.astype(h.dtype))
        return gather_from_tensor_parallel_region(logits, axis, dim=-1)

    def _positions(self, tokens: jax.Array, positions: Any) -> jax.Array:
        cp = 1 if self.layout is None else self.layout.cp
        if cp == 1:
            _refuse_unlaid_cp(self.layout)
        if positions is None:
            if cp > 1:
                raise ValueError(
                    f"{API}: the model runs with context parallelism (cp={cp}), so each "
                    "rank holds a shard of the sequence and positions from arange would be "
                    "wrong; pass positions= (each token's global position): put a "
                    "'positions' leaf of np.arange(seq) per sequence in the batch so that "
                    "context_parallel= splits it with the tokens.")
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        positions = jnp.asarray(positions)
        if positions.shape != tokens.shape:
            positions = jnp.broadcast_to(positions, tokens.shape)
        return positions


def _refuse_unlaid_cp(layout: Any) -> None:
    """A model laid out without cp must not run where a cp axis of size > 1 is bound: its
    attention would attend within each rank's shard only."""
    names = ("cp", "sep") if layout is None else (layout.cp_axis_name,)
    for name in names:
        try:
            size = lax.axis_size(name)
        except NameError:
            continue
        if size > 1:
            raise ValueError(
                f"{API}: the model's attention is plain (laid out without context "
                f"parallelism) but runs in SPMD code whose {name!r} axis has size {size}, "
                "so each rank would attend within its own shard of the sequence; lay it "
                "out with jaxpg.models.parallelize(model, dims) for a ParallelDims with "
                f"cp={size}, or run it without the cp split.")
