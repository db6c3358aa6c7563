"""The router: each token's top-k experts and their weights (Mixtral's or GShard's rule)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["Routing", "route"]


class Routing(NamedTuple):
    """What the router decided for this rank's tokens.

    Attributes:
        probs: ``(tokens, E)`` the full softmax of the logits (for the auxiliary loss).
        experts: ``(tokens, top_k)`` int32 chosen experts, highest logit first.
        weights: ``(tokens, top_k)`` each choice's weight.
    """

    probs: jax.Array
    experts: jax.Array
    weights: jax.Array


def route(x: jax.Array, gate_w: jax.Array, top_k: int, normalize_topk: bool) -> Routing:
    """Routes ``x`` by ``logits = x @ gate_w``.

    Args:
        x: ``(tokens, d)``.
        gate_w: ``(d, E)``.
        top_k: how many experts each token picks, by logit.
        normalize_topk: True: the weights are the softmax over the chosen logits
            (Mixtral); False: the full softmax's probabilities of the chosen experts
            (GShard, Switch).
    """
    logits = jnp.dot(x, gate_w, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    top_logits, experts = lax.top_k(logits, top_k)
    if normalize_topk:
        weights = jax.nn.softmax(top_logits, axis=-1)
    else:
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    return Routing(probs, experts.astype(jnp.int32), weights.astype(x.dtype))
