"""What travels between pipeline stages: activations with gradients, side inputs without.

A stage returns an array or a tuple of arrays, the next stage's inputs. Floating-point
arrays (the activations) travel forward and their gradients travel back; integer and bool
arrays (position ids, attention masks, segment ids) travel forward beside them, on the same
lanes, and take no gradient: the stage's pullback is taken in its parameters and its
floating-point inputs only, so a backward sends back only the activations' gradients, as
torch pipelining sends none for its stages' non-float outputs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["StageOutputError", "carries_grad", "grad_leaves", "check_stage_output"]


class StageOutputError(TypeError):
    """A stage returned what cannot travel to the next stage (or reach the loss)."""


def carries_grad(a: Any) -> bool:
    """Whether ``a`` (an array or shape struct) takes a gradient: floating point."""
    return bool(jnp.issubdtype(a.dtype, jnp.floating))


def _side(a: Any) -> bool:
    return bool(jnp.issubdtype(a.dtype, jnp.integer) or jnp.issubdtype(a.dtype, jnp.bool_))


def grad_leaves(tree: Any) -> tuple:
    """The leaves of ``tree`` that take a gradient, in order (what a backward sends)."""
    return tuple(a for a in jax.tree.leaves(tree) if carries_grad(a))


def _shown(out: Any) -> str:
    def one(a: Any) -> str:
        if hasattr(a, "shape") and hasattr(a, "dtype"):
            return f"{a.dtype}[{','.join(str(d) for d in a.shape)}]"
        return f"{type(a).__name__} {a!r}"[:80]

    if isinstance(out, tuple | list):
        return "(" + ", ".join(one(a) if not isinstance(a, tuple | list | dict) else
                               type(a).__name__ for a in out) + ")"
    return one(out) if not isinstance(out, dict) else f"a dict with keys {sorted(out)}"


def check_stage_output(out: Any, where: str, *, travels: bool) -> None:
    """Raises :class:`StageOutputError` (a ``TypeError``) unless ``out`` (a stage's output,
    values or shape structs) is an array or a tuple of arrays (of rank >= 1, floating,
    integer or bool where it ``travels`` to a next stage, with at least one floating array
    to carry the gradient back).

    Args:
        out: what the stage returned (or its shape structs).
        where: the stage, for the message (``"Schedule1F1B (pipeline rank 0): stage 0
            (Embed)"``).
        travels: whether the output goes to another stage (not only to the loss).
    """
    fix = ("return an array or a tuple of arrays: floating-point arrays (activations) "
           "travel to the next stage with their gradients, integer and bool arrays "
           "(position ids, masks) beside them without")
    items = tuple(out) if isinstance(out, tuple | list) else (out,)
    for a in items:
        if not (isinstance(a, jax.ShapeDtypeStruct | jax.Array | np.ndarray)):
            raise StageOutputError(f"{where} returns {_shown(out)}, not an array or a tuple of "
                            f"arrays; {fix}.")
    if not travels:
        return
    for a in items:
        if len(a.shape) == 0:
            raise StageOutputError(f"{where} returns {_shown(out)}, with a scalar; arrays travel "
                            "between stages with their batch dimension first: return arrays "
                            "of rank >= 1.")
        if not (carries_grad(a) or _side(a)):
            raise StageOutputError(f"{where} returns {_shown(out)}, with a {a.dtype} array; {fix}.")
    if not any(carries_grad(a) for a in items):
        raise StageOutputError(f"{where} returns {_shown(out)}, no floating-point array: nothing "
                        "would carry the gradient back to it; return the activations "
                        "beside the integer or bool arrays.")
