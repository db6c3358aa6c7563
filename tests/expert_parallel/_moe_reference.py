"""The one-device reference for ``moe``: every expert runs densely on every token, and the
capacity rule is a plain loop over the global order (slot, then token)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np


def _choices(x, gate_w, top_k):
    logits = x @ gate_w
    probs = jax.nn.softmax(logits, axis=-1)
    top_logits, experts = jax.lax.top_k(logits, top_k)
    return probs, top_logits, experts


def reference_keep(x, gate_w, *, top_k, capacity_factor):
    """``(keep (T, k) bool, counts (E,), dropped)`` by a loop over the global order."""
    _, _, experts = jax.jit(_choices, static_argnums=2)(x, gate_w, top_k)
    chosen = np.asarray(experts)
    tokens, num_experts = x.shape[0], gate_w.shape[1]
    keep = np.ones(chosen.shape, bool)
    counts = np.bincount(chosen.reshape(-1), minlength=num_experts)
    if capacity_factor is not None:
        capacity = max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))
        taken = np.zeros(num_experts, int)
        for j in range(top_k):  # all first choices before any second choice
            for t in range(tokens):
                e = chosen[t, j]
                keep[t, j] = taken[e] < capacity
                taken[e] += 1
    return keep, counts, int((~keep).sum())


@functools.partial(jax.jit, static_argnames=("top_k", "normalize_topk", "activation"))
def reference_forward(x, gate_w, w1, w2, keep, counts, *, top_k, normalize_topk=True,
                      activation=jax.nn.gelu):
    """``(y, aux loss)`` given the kept choices; differentiable in x, gate_w, w1, w2."""
    tokens, num_experts = x.shape[0], gate_w.shape[1]
    probs, top_logits, experts = _choices(x, gate_w, top_k)
    weights = (jax.nn.softmax(top_logits, axis=-1) if normalize_topk
               else jnp.take_along_axis(probs, experts, axis=-1))
    every = jax.vmap(lambda a, b: activation(x @ a) @ b)(w1, w2)  # (E, T, d)
    picked = every[experts, jnp.arange(tokens)[:, None]]  # (T, k, d)
    y = jnp.einsum("tk,tkd->td", weights * keep.astype(x.dtype), picked)
    share = counts / (tokens * top_k)
    return y, num_experts * jnp.sum(share * jnp.mean(probs, axis=0))


def reference_moe(x, gate_w, w1, w2, *, top_k, capacity_factor=None, activation=jax.nn.gelu,
                  normalize_topk=True):
    """``(y, loss, counts, dropped)`` on one device; ``x`` is the whole batch ``(T, d)``,
    ``w1``/``w2`` all ``E`` experts."""
    keep, counts, dropped = reference_keep(x, gate_w, top_k=top_k,
                                           capacity_factor=capacity_factor)
    y, loss = reference_forward(x, gate_w, w1, w2, keep, counts, top_k=top_k,
                                normalize_topk=normalize_topk, activation=activation)
    return y, loss, counts, dropped


def reference_loss_and_grads(x, gate_w, w1, w2, cot, **options):
    """``sum(y · cot) + aux loss`` and its gradients in (x, gate_w, w1, w2), jitted."""
    keep, counts, _ = reference_keep(x, gate_w, top_k=options["top_k"],
                                     capacity_factor=options.get("capacity_factor"))
    forward = functools.partial(reference_forward, top_k=options["top_k"],
                                normalize_topk=options.get("normalize_topk", True))

    def loss(x, gate_w, w1, w2):
        y, aux = forward(x, gate_w, w1, w2, keep, counts)
        return jnp.sum(y * cot) + aux

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, gate_w, w1, w2)
