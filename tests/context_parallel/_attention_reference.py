"""A numpy reference for softmax attention over the whole sequence, and its gradients."""

import numpy as np


def full_attention(q, k, v, causal, w):
    """Returns ``o = softmax(q k^T / sqrt(d)) v`` and the gradients of ``sum(o * w)`` with
    respect to q, k and v (float64 numpy, the textbook formulas)."""
    q, k, v, w = (np.asarray(a, np.float64) for a in (q, k, v, w))
    scale = 1.0 / np.sqrt(q.shape[-1])
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        n = q.shape[1]
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", p, v)
    dv = np.einsum("bhqk,bqhd->bkhd", p, w)
    dp = np.einsum("bqhd,bkhd->bhqk", w, v)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
    dq = np.einsum("bhqk,bkhd->bqhd", ds, k)
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q)
    return o, dq, dk, dv
