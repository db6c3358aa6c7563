"""Flax NNX modules as pipeline stages: stacked copies of a block, pure apply functions.

The executor works on pure functions and pytrees. ``stack_modules`` builds ``n``
independently initialised copies of a block (``n = p * v`` model stages), splits each
with ``nnx.split`` and stacks their states leaf by leaf, so every leaf gets a leading
stage dimension in model order. ``module_fn`` turns a ``GraphDef`` back into
``fn(state, *args)`` by ``nnx.merge``, usable as ``stage_fn``, ``first_fn`` or inside
``loss_fn``. Blocks should be deterministic (no dropout RNG state in the split state).

Example:
    >>> from flax import nnx
    >>> graphdef, stacked = stack_modules(lambda rngs: nnx.Linear(8, 8, rngs=rngs), 4)
    >>> stage_fn = module_fn(graphdef)
    >>> stacked["kernel"][...].shape
    (4, 8, 8)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["stack_modules", "split_module", "module_fn"]


def split_module(module: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
    """``nnx.split`` of ``module``: its static graph and its state (a pytree)."""
    if not isinstance(module, nnx.Module):
        raise TypeError(f"module must be an nnx.Module, got {type(module).__name__}.")
    return nnx.split(module)


def stack_modules(
    make_block: Callable[[nnx.Rngs], nnx.Module], num: int, *, seed: int = 0
) -> tuple[nnx.GraphDef, nnx.State]:
    """Builds ``num`` copies of a block and stacks their states along a new leading axis.

    Args:
        make_block: ``make_block(rngs) -> module``; called once per stage, each with
            ``nnx.Rngs(seed + stage)``.
        num: the number of copies (model stages), ``p * v`` for the executor.
        seed: the first copy's seed.

    Returns:
        ``(graphdef, stacked_state)``: the common graph and the stacked state, whose
        leaves have a leading dimension ``num``.

    Raises:
        ValueError: if ``num < 1`` or the copies differ in structure or shapes.
    """
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise ValueError(f"num must be a positive int, got {num!r}.")
    splits = [split_module(make_block(nnx.Rngs(seed + i))) for i in range(num)]
    graphdef = splits[0][0]
    states = [state for _, state in splits]
    shapes = [jax.tree.map(jnp.shape, s) for s in states]
    for i, shape in enumerate(shapes[1:], start=1):
        if shape != shapes[0]:
            raise ValueError(
                f"make_block built copies that differ: copy 0 has {shapes[0]} but copy {i} "
                f"has {shape}; every pipeline stage must have the same parameter shapes."
            )
    return graphdef, jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)


def module_fn(graphdef: nnx.GraphDef) -> Callable[..., Any]:
    """Returns ``fn(state, *args)`` that merges ``graphdef`` with ``state`` and calls it."""

    def fn(state: nnx.State, *args: Any) -> Any:
        return nnx.merge(graphdef, state)(*args)

    return fn
