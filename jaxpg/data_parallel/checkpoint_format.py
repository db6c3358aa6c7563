"""The arrays a DDP or FSDP checkpoint holds: the state tree's leaves numbered ``00000``,
``00001``, ... in ``jax.tree`` order, PRNG keys as their raw data, empty leaves left out
(orbax refuses them; a restore takes them from the model)."""

from __future__ import annotations

from typing import Any

import jax

from jaxpg.data_parallel.prng_keys import is_key, rekey_like

__all__ = ["numbered_arrays", "restore_leaves"]


def numbered_arrays(leaves: list[Any]) -> dict[str, Any]:
    """The arrays saved for ``leaves``, by their number."""
    return {f"{i:05d}": (jax.random.key_data(x) if is_key(x) else x)
            for i, x in enumerate(leaves) if x.size}


def restore_leaves(leaves: list[Any], restored: dict[str, Any]) -> list[Any]:
    """``leaves`` with each value a checkpoint restored (keys wrapped back as the model's)."""
    return [rekey_like(old, restored.get(f"{i:05d}", old)) for i, old in enumerate(leaves)]
