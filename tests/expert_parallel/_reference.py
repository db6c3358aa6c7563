"""The one-device reference for ``moe``: every expert runs densely on every token, and the
capacity rule is a plain loop over the global order (slot, then token)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def reference_moe(x, gate_w, w1, w2, *, top_k, capacity_factor=None, activation=jax.nn.gelu,
                  normalize_topk=True):
    """``(y, loss, counts, dropped)`` on one device; ``x`` is the whole batch ``(T, d)``,
    ``w1``/``w2`` all ``E`` experts."""
    tokens, num_experts = x.shape[0], gate_w.shape[1]
    logits = x @ gate_w
    probs = jax.nn.softmax(logits, axis=-1)
    top_logits, experts = jax.lax.top_k(logits, top_k)
    weights = (jax.nn.softmax(top_logits, axis=-1) if normalize_topk
               else jnp.take_along_axis(probs, experts, axis=-1))
    chosen = np.asarray(experts)
    keep = np.ones(chosen.shape, bool)
    counts = np.bincount(chosen.reshape(-1), minlength=num_experts)
    dropped = 0
    if capacity_factor is not None:
        capacity = max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))
        taken = np.zeros(num_experts, int)
        for j in range(top_k):
            for t in range(tokens):
                e = chosen[t, j]
                keep[t, j] = taken[e] < capacity
                taken[e] += 1
        dropped = int((~keep).sum())
    every = jnp.stack([activation(x @ w1[e]) @ w2[e] for e in range(num_experts)])  # (E,T,d)
    picked = every[experts, jnp.arange(tokens)[:, None]]  # (T, k, d)
    y = jnp.einsum("tk,tkd->td", weights * jnp.asarray(keep, x.dtype), picked)
    share = counts / (tokens * top_k)
    loss = num_experts * jnp.sum(share * jnp.mean(probs, axis=0))
    return y, loss, counts, dropped
