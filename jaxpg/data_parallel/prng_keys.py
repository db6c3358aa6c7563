"""PRNG key leaves (``jax.random.key``) in a state tree: found, turned into raw data for a
collective or a checkpoint, and wrapped back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["is_key", "unkey", "rekey_like"]


def is_key(x: Any) -> bool:
    """Whether ``x`` is an array of typed PRNG keys."""
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def unkey(tree: Any) -> tuple[Any, Callable[[Any], Any]]:
    """Replaces PRNG key leaves by their raw data; returns the tree and a function undoing it."""
    leaves, treedef = jax.tree.flatten(tree)
    impls = [jax.random.key_impl(x) if is_key(x) else None for x in leaves]
    raw = [jax.random.key_data(x) if i is not None else x for x, i in zip(leaves, impls)]

    def rekey(new_tree: Any) -> Any:
        new = jax.tree.leaves(new_tree)
        return treedef.unflatten(
            [jax.random.wrap_key_data(x, impl=i) if i is not None else x
             for x, i in zip(new, impls, strict=True)]
        )

    return treedef.unflatten(raw), rekey


def rekey_like(old: Any, value: Any) -> Any:
    """``value`` (raw key data, when ``old`` is a key array) as keys of ``old``'s kind."""
    if is_key(old) and value is not old:
        return jax.random.wrap_key_data(value, impl=jax.random.key_impl(old))
    return value
