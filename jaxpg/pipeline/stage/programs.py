"""A plain pipeline stage's programs: forward (with the loss on the last stage) and the
backward, whole or split into its input and weight halves, each one jitted program.

``F`` runs ``jax.vjp`` of the stage (of stage and loss on the last), in its parameters and
its floating-point inputs (integer and bool side inputs travel without gradients:
``jaxpg.pipeline.stage.carried``), and keeps the pullback's residuals until the backward;
``B`` applies it (with a split backward, ``B`` makes only the input gradient and ``W`` only
the weight gradient, XLA dropping the other half of each). A tensor-parallel or fully
sharded stage runs the same programs inside SPMD programs over its sub-mesh
(``jaxpg.pipeline.stage.submesh_programs``): a fully sharded stage's ``gather`` all-gathers
its parameter shards inside the differentiated function, recomputed in the backward rather
than kept (``jax.checkpoint``), and its per-rank loss is divided by ``shards`` so that the
ranks' gradients sum to the gradient of the microbatch's mean.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpg.data_parallel.loss_check import check_depends
from jaxpg.pipeline.stage.carried import carries_grad
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

    forward: Callable  # (p, rest, args) -> (out, vjp); vjp takes out's float leaves' cotangents
    forward_loss: Callable  # (p, rest, args, target) -> (loss, out, vjp)
    backward: Callable  # (vjp, dy, g) -> (dx of the float input leaves, g + dp)
    backward_input: Callable  # (vjp, dy) -> dx
    weight: Callable  # (vjp, dy, g) -> g + dp


GATHERED = "jaxpg_fsdp_gathered"
"""The ``checkpoint_name`` of a fully sharded stage's gathered parameters (never kept)."""


def _unless_gathered(prim: Any, *_: Any, **params: Any) -> bool:
    """A ``jax.checkpoint`` policy: save every value but an all-gather's (and its named
    alias): the gathered parameters are gathered again in the backward, as FSDP does."""
    return not (str(prim) == "all_gather" or params.get("name") == GATHERED)


@functools.lru_cache(maxsize=64)
def plain_programs(graphdef: Any, loss_fn: Callable | None, first: bool,
                   gather: Callable | None = None, shards: int = 1) -> StagePrograms:
    """The programs of a stage of module structure ``graphdef`` with ``loss_fn`` (``first``:
    the model's first stage, whose inputs take no gradient); made once per structure.
    ``gather`` (inside an SPMD program): parameter shards -> whole parameters, names its
    results :data:`GATHERED`; ``shards``: what each rank's loss is divided by."""
    def merged(p, rest, *a):
        out = nnx.merge(graphdef, p if gather is None else gather(p), rest)(*a)
        return tuple(out) if isinstance(out, tuple | list) else (out,)

    call = merged if gather is None else jax.checkpoint(merged, policy=_unless_gathered)

    def pullback(f, p, rest, args, **kw):
        """``jax.vjp`` of ``f(p, rest, *args)`` in ``p`` and, after the first stage, the
        floating-point leaves of ``args`` (integer and bool side inputs take none)."""
        leaves, tree = jax.tree.flatten(args)
        at = () if first else tuple(i for i, a in enumerate(leaves) if carries_grad(a))

        def g(p, *diff):
            full = list(leaves)
            for i, x in zip(at, diff, strict=True):
                full[i] = x
            return f(p, rest, *jax.tree.unflatten(tree, full))

        return jax.vjp(g, p, *(leaves[i] for i in at), **kw)

    def forward(p, rest, args):
        found = []  # the output's structure, at trace time

        def f(p, rest, *a):
            leaves, tree = jax.tree.flatten(call(p, rest, *a))
            found.append(tree)
            return (tuple(x for x in leaves if carries_grad(x)),
                    tuple(None if carries_grad(x) else x for x in leaves))

        floats, vjp, side = pullback(f, p, rest, args, has_aux=True)
        it = iter(floats)
        out = [next(it) if x is None else x for x in side]
        return jax.tree.unflatten(found[-1], out), vjp

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
            loss = loss_fn(y, target)
            return (loss if shards == 1 else loss / shards), out

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
