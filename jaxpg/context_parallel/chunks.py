"""Which global sequence positions each context-parallel rank holds.

Contiguous: rank ``i`` of ``cp`` holds positions ``[i * s, (i + 1) * s)`` with
``s = seq / cp``. Load-balanced (for causal masks, as torch's and MaxText's context
parallelism): the sequence is cut into ``2 * cp`` chunks and rank ``i`` holds chunks ``i``
and ``2 * cp - 1 - i``, so every rank has the same share of the causal triangle.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["local_positions", "chunk_order", "all_positions"]


def chunk_order(cp: int, load_balance: bool) -> list[int]:
    """The global chunk indices in the order the ranks hold them (rank 0's first).

    With ``load_balance`` there are ``2 * cp`` chunks, else ``cp``.
    """
    if not load_balance:
        return list(range(cp))
    return [c for i in range(cp) for c in (i, 2 * cp - 1 - i)]


def local_positions(rank: Any, cp: int, seq_local: int, load_balance: bool) -> Any:
    """The global positions of rank ``rank``'s ``seq_local`` tokens.

    ``rank`` may be a Python int (numpy result) or a traced integer (jax result).
    """
    xp = np if isinstance(rank, (int, np.integer)) else jnp
    if not load_balance:
        return rank * seq_local + xp.arange(seq_local)
    c = seq_local // 2
    first = rank * c + xp.arange(c)
    second = (2 * cp - 1 - rank) * c + xp.arange(c)
    return xp.concatenate([first, second])


def all_positions(cp: int, seq_local: int, load_balance: bool) -> np.ndarray:
    """Every rank's positions, concatenated in rank order (what an all-gather lays out)."""
    return np.concatenate([local_positions(r, cp, seq_local, load_balance)
                           for r in range(cp)])
