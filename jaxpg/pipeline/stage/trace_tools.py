"""What the pipeline's traced programs share: evaluating a jaxpr's equations, telling its
variables from its literals, finding the axes a collective is bound over, the
shape-and-dtype keys their caches and lanes use, and the one gradient accumulator."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var

__all__ = ["is_var", "eval_eqns", "leaves_key", "tree_key", "add_grads", "bound_axes"]


def is_var(v: Any) -> bool:
    """Whether ``v`` is a jaxpr variable (not a literal)."""
    return isinstance(v, Var) and not isinstance(v, Literal)


def eval_eqns(eqns: Sequence[Any], env: dict) -> None:
    """Evaluates ``eqns`` in order in the current trace, reading and writing ``env``."""
    for eqn in eqns:
        invals = [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars]
        with eqn.ctx.manager:
            outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
        if not eqn.primitive.multiple_results:
            outs = [outs]
        env.update(zip(eqn.outvars, outs, strict=True))


def leaves_key(leaves: Iterable[Any]) -> tuple:
    """Each leaf's ``(shape, dtype name)``: equal for arrays of the same shapes and dtypes."""
    return tuple((tuple(a.shape), str(np.dtype(a.dtype))) for a in leaves)


def tree_key(tree: Any) -> tuple:
    """``tree``'s structure and :func:`leaves_key` of its leaves (a cache key)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, leaves_key(leaves)


def add_grads(acc: Any, value: Any) -> Any:
    """``acc + value`` leaf by leaf (``value`` itself for the first, ``acc=None``)."""
    return value if acc is None else jax.tree.map(jnp.add, acc, value)


def _sub_jaxprs(value: Any) -> Iterable[Jaxpr]:
    if isinstance(value, ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, Jaxpr):
        yield value
    elif isinstance(value, tuple | list):
        for v in value:
            yield from _sub_jaxprs(v)


def bound_axes(jaxpr: Jaxpr | ClosedJaxpr, primitive: str) -> set[str]:
    """The mesh axes over which ``jaxpr``, or any jaxpr nested in it (conds, loops,
    custom derivatives, remat), binds the collective ``primitive`` (``"ppermute"``)."""
    found: set[str] = set()
    for eqn in (jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr).eqns:
        if eqn.primitive.name == primitive:
            names = eqn.params.get("axis_name", ())
            found.update(names if isinstance(names, tuple | list) else (names,))
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                found |= bound_axes(sub, primitive)
    return found
