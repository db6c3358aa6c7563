"""A plain pipeline stage's programs: forward (with the loss on the last stage) and the
backward, whole or split into its input and weight halves, each one jitted program.

``F`` runs ``jax.vjp`` of the stage (of stage and loss on the last) and keeps the
pullback's residuals until the backward; ``B`` applies it (with a split backward, ``B``
makes only the input gradient and ``W`` only the weight gradient, XLA dropping the other
half of each). A tensor-parallel stage runs the same programs inside SPMD programs over its
tp group (``jaxpg.pipeline.stage.tp_programs``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpg.data_parallel.loss_check import check_depends
from jaxpg.pipeline.stage.trace_tools import add_grads

__all__ = ["StagePrograms", "plain_programs"]

LOSS_CAUSE = (
    "A schedule's loss_fn(output, target) must compute the loss from the last stage's "
    "output. The usual cause: a loss that closes over the module as it was before the "
    "stage took it (`lambda out, t: ce(model(x), t)`) instead of using output."
)


def _structs(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), a.dtype), tree)


class StagePrograms(NamedTuple):
    """One stage's jitted programs (see the module docstring)."""

    forward: Callable  # (p, rest, args) -> (out, vjp)
    forward_loss: Callable  # (p, rest, args, target) -> (loss, out, vjp)
    backward: Callable  # (vjp, dy, g) -> (dx, g + dp)
    backward_input: Callable  # (vjp, dy) -> dx
    weight: Callable  # (vjp, dy, g) -> g + dp


@functools.lru_cache(maxsize=64)
def plain_programs(graphdef: Any, loss_fn: Callable | None, first: bool) -> StagePrograms:
    """The programs of a stage of module structure ``graphdef`` with ``loss_fn`` (``first``:
    the model's first stage, whose inputs take no gradient); made once per structure."""
    def call(p, rest, *a):
        out = nnx.merge(graphdef, p, rest)(*a)
        return tuple(out) if isinstance(out, tuple | list) else (out,)

    def pullback(f, p, rest, args, **kw):
        if first:  # the model's inputs take no gradient (token ids, say)
            return jax.vjp(lambda p: f(p, rest, *args), p, **kw)
        return jax.vjp(lambda p, *a: f(p, rest, *a), p, *args, **kw)

    def forward(p, rest, args):
        return pullback(call, p, rest, args)

    checked = []  # the loss check runs on the first trace only

    def forward_loss(p, rest, args, target):
        def f(p, rest, *a):
            out = call(p, rest, *a)
            y = out[0] if len(out) == 1 else out
            if not checked:
                check_depends(loss_fn, (_structs(y), _structs(target)), (True, False),
                              loss_fn=loss_fn, api="PipelineStage schedule",
                              model="its output argument", cause=LOSS_CAUSE)
                checked.append(True)
            return loss_fn(y, target), out

        loss, vjp, out = pullback(f, p, rest, args, has_aux=True)
        return loss, out, vjp

    def backward(vjp, dy, g):
        grads = vjp(dy)
        return tuple(grads[1:]), add_grads(g, grads[0])

    def backward_input(vjp, dy):
        return tuple(vjp(dy)[1:])

    def weight(vjp, dy, g):
        return add_grads(g, vjp(dy)[0])

    return StagePrograms(jax.jit(forward), jax.jit(forward_loss),
                         jax.jit(backward, donate_argnums=(2,)), jax.jit(backward_input),
                         jax.jit(weight, donate_argnums=(2,)))  # fmt: skip
