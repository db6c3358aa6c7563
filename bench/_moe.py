"""The MoE layer the expert-parallel benchmarks time: one definition of its weights and loss.

``bench/_expert_parallel_single.py`` (one process, simulated devices) and
``bench/_expert_parallel_worker.py`` (one rank per process, beside torch) both run
``jaxpg.expert_parallel.moe`` with a router ``[d, E]`` and experts ``w1 [E, d, f]``,
``w2 [E, f, d]``, and take the gradient of ``sum(y * cotangent)`` plus the router's
auxiliary loss at ``AUX_WEIGHT``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxpg.expert_parallel import moe

AUX_WEIGHT = 0.01


def moe_weights(rng: np.random.Generator, dim: int, ffn: int, experts: int):
    """``(gate [d, E], w1 [E, d, f], w2 [E, f, d])``, float32, drawn from ``rng`` in that
    order (so both benchmarks draw the same weights from the same seed)."""
    gate = (rng.normal(size=(dim, experts)) / np.sqrt(dim)).astype(np.float32)
    w1 = (rng.normal(size=(experts, dim, ffn)) / np.sqrt(dim)).astype(np.float32)
    w2 = (rng.normal(size=(experts, ffn, dim)) / np.sqrt(ffn)).astype(np.float32)
    return gate, w1, w2


def moe_loss(group, top_k: int, **moe_kwargs):
    """``loss(x, gate_w, w1, w2, cot)`` of one rank: ``sum(moe(...) * cot)`` plus the
    auxiliary loss, over ``group`` (``moe_kwargs``: ``capacity_factor``, ...)."""

    def loss(x, gate_w, w1, w2, cot):
        y, aux = moe(x, gate_w, w1, w2, group=group, top_k=top_k, **moe_kwargs)
        return jnp.sum(y * cot) + AUX_WEIGHT * aux.loss

    return loss
