"""Pipeline stage boundaries: a model's decoder layers cut into consecutive stages.

:func:`stage_bounds` gives the split points (``[0, b1, ..., num_layers]``), balancing
the layers with the embedding counted on the first stage and the head on the last (each
as ``edge_cost`` layers). :func:`pipeline_stages` returns one NNX module per stage that
shares the model's parameters: stage 0 embeds the tokens, the last applies the final
norm and the head, and chaining them is the model's forward. Each takes
``(x, positions)``: token ids (stage 0) or hidden states, and the global positions; each
but the last returns ``(hidden states, positions)``, the next one's inputs, so that
``jaxpg.pipeline.PipelineStage`` carries the positions between stages.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpg.models.config import ModelConfig
from jaxpg.models.rope import inverse_frequencies, rope_tables

__all__ = ["stage_bounds", "pipeline_stages", "Stage"]


def stage_bounds(config: ModelConfig, num_stages: int, *, edge_cost: float = 0.0
                 ) -> list[int]:
    """The layer index where each stage starts, and ``num_layers`` at the end.

    Args:
        config: the model's config.
        num_stages: how many stages (at most ``num_layers``).
        edge_cost: the embedding's (first stage) and the head's (last stage) cost, in
            layers; 0 splits the layers evenly, earlier stages taking the remainder.

    Raises:
        ValueError: ``num_stages`` not between 1 and ``num_layers``.
    """
    n = config.num_layers
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or not 1 <= num_stages <= n:
        raise ValueError(f"stage_bounds: num_stages={num_stages!r} must be an int between 1 "
                         f"and num_layers={n}.")
    extra = [0.0] * num_stages
    extra[0] += edge_cost
    extra[-1] += edge_cost
    cost = n + sum(extra)
    bounds, start = [0], 0
    for s in range(num_stages - 1):
        left = num_stages - s
        size = round(cost / left - extra[s])
        size = max(1, min(size, n - start - (left - 1)))
        start += size
        cost -= size + extra[s]
        bounds.append(start)
    bounds.append(n)
    return bounds


class Stage(nnx.Module):
    """Layers ``[start, stop)`` of a ``CausalLM``, with its embedding on the first stage and
    its norm and head on the last (the model's own submodules, not copies)."""

    def __init__(self, model: Any, start: int, stop: int):
        self.config = model.config
        self.first = start == 0
        self.last = stop == model.config.num_layers
        if self.first:
            self.embed_tokens = model.embed_tokens
        self.layers = nnx.List(list(model.layers)[start:stop])
        if self.last:
            self.norm = model.norm
            if hasattr(model, "lm_head"):
                self.lm_head = model.lm_head

    def __call__(self, x: jax.Array, positions: jax.Array
                 ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """The stage's layers on ``x`` (token ids on the first stage); the last stage gives
        the logits, the others ``(hidden states, positions)``: the next stage's inputs, the
        positions carried beside the activations (as torch's ``PipelineStage`` carries a
        stage's outputs; under context parallelism they are not ``arange(seq)``)."""
        if self.first:
            x = self.embed_tokens(x)
        cos, sin = rope_tables(jnp.broadcast_to(positions, x.shape[:2]),
                               inverse_frequencies(self.config))
        for layer in self.layers:
            x = layer(x, cos, sin)
        if self.last:
            x = self.norm(x)
            if hasattr(self, "lm_head"):
                return self.lm_head(x)
            table = self.embed_tokens.embedding[...]  # tied: one stage holds both
            return jnp.einsum("bsd,vd->bsv", x, table.astype(x.dtype))
        return x, positions


def pipeline_stages(model: Any, num_stages: int | None = None, *,
                    bounds: list[int] | None = None) -> list[Stage]:
    """The model cut into stages (at ``bounds``, or :func:`stage_bounds`'s even split).

    Raises:
        ValueError: tied embeddings with more than one stage (the first and last stages
            would share the table: untie them), or bounds that are not increasing from 0 to
            ``num_layers``.
    """
    config = model.config
    if bounds is None:
        bounds = stage_bounds(config, 1 if num_stages is None else num_stages)
    bounds = list(bounds)
    n = config.num_layers
    if (len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != n
            or any(b <= a for a, b in zip(bounds, bounds[1:]))):
        raise ValueError(f"pipeline_stages: bounds={bounds} must increase from 0 to "
                         f"num_layers={n}.")
    if config.tie_word_embeddings and len(bounds) > 2:
        raise ValueError("pipeline_stages: the model ties its head to the embedding, which "
                         "the first and last stages would share; load it with "
                         "tie_word_embeddings=False (a copied head) to pipeline it.")
    return [Stage(model, a, b) for a, b in zip(bounds, bounds[1:])]
