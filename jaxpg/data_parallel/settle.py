"""Waiting for a wrapper's construction to finish on the devices.

A wrapper's constructor places and broadcasts its state with jitted programs that hold
collectives (over the data-parallel axes, or over the whole mesh), dispatched without
waiting. Across processes, the first checked call that follows (the default signature
check is a small collective with no data dependency on that state) could then meet a
peer's still-running placement in XLA's gloo collectives, which pair operations by order,
and abort on a size mismatch. Waiting once at the end of construction orders them.
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["settle_placement"]


def settle_placement(state: Any) -> None:
    """Blocks until every array of ``state`` is computed, when more than one process runs.

    Args:
        state: the pytree a constructor just placed (parameters, optimizer state, ...).
    """
    if jax.process_count() > 1:
        jax.block_until_ready([x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)])
