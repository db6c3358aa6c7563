"""An NNX attention core that runs :func:`~jaxpg.context_parallel.attention`.

A GPT block computes its projections as usual and hands ``q, k, v`` to this layer instead
of its own softmax: in SPMD code binding the cp axis the layer attends over the sequence
split across the group; with no context-parallel group (``group=False``) it is plain
attention, so one block class serves the one-device model and the context-parallel one.
The layer has no parameters; it reads the head count from the array at hand, so heads
split by tensor parallelism (``ColwiseParallel`` on the QKV projection) work unchanged.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpg.context_parallel.attention import attention
from jaxpg.context_parallel.blocks import dense_attention

__all__ = ["ContextParallelAttention"]


class ContextParallelAttention(nnx.Module):
    """Softmax attention of ``(batch, seq_local, heads, head_dim)`` shards.

    Args:
        group: the context-parallel group (a ProcessGroup, ``mesh["cp"]``), or False for
            plain one-device attention over the whole sequence.
        causal: mask later positions.
        method: ``"ring"``, ``"all_to_all"`` or ``"all_gather"``.
        load_balance: the shards' layout (None: ``causal``), as ``shard_sequence``'s.

    Example:
        >>> attn = ContextParallelAttention(group=mesh["cp"], causal=True)
        >>> o = attn(q, k, v)   # inside spmd code over the mesh
    """

    def __init__(self, *, group: Any = None, causal: bool = True, method: str = "ring",
                 load_balance: bool | None = None):
        self.group = group
        self.causal = causal
        self.method = method
        self.load_balance = load_balance

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        if self.group is False:
            mask = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)) if self.causal else None
            return dense_attention(q, k, v, q.shape[-1] ** -0.5, mask)
        return attention(q, k, v, group=self.group, causal=self.causal, method=self.method,
                         load_balance=self.load_balance)
