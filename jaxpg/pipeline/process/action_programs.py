"""One compiled program per kind of pipeline action, for the process executor.

The process executor (``jaxpg.pipeline.process.executor``) runs every action of its rank as one
call of a jitted program on the rank's device, dispatched asynchronously: the host
queues the next action while the device still runs the last, and a message leaves as
soon as the action that made it is done. The programs are the tick steps of the SPMD
executor (``jaxpg.pipeline.lockstep.tick_program``) taken one by one, without the conditionals:

* ``forward(pc, x) -> (y, res)``; ``forward_first`` embeds microbatch rows of the inputs
  first (and returns the stage input, kept for the backward); ``forward_last`` runs the
  head and loss too and returns ``d(loss / m) / dy``, the last stage's output gradient.
* ``backward(pc, x, dy, res, g) -> (dx, g + dp)`` (a whole backward); with a split
  backward ``backward_input(pc, x, dy, res) -> (dx, wres)`` and
  ``weight(g, pc, x, dy, res, wres, go) -> g + dp``. On the first stage the backward
  adds the embedding's gradient as well, and returns no ``dx``.

``pc`` is one chunk's parameters with a leading dimension of 1 (a rank's block of a
stage stack placed ``P('pp')``, read in place), ``x`` the stage input, ``dy`` the
output gradient, ``res`` and ``wres`` the residuals of ``jaxpg.pipeline.stage.split``
(empty with remat, where the backward recomputes the stage). Accumulators (``g``, the
loss and head gradient, the embedding gradient) are donated and updated in place; the
first action to write one gets ``None`` and writes the gradient itself, so no
accumulator is ever filled with zeros. Accumulators carry a leading dimension of 1 (the
loss is ``[1]``), so that each is one block of a global array as it is. Programs depend
only on shapes, so every schedule of a model shares them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxpg.pipeline.stage.split import StagePieces, split_stage
from jaxpg.pipeline.stage.trace_tools import add_grads, tree_key

__all__ = ["ActionPrograms", "action_programs"]


class ActionPrograms(NamedTuple):
    """The jitted programs of one model (see the module docstring)."""

    forward: Callable
    forward_first: Callable
    forward_last: Callable
    forward_first_last: Callable
    backward: Callable
    backward_first: Callable
    backward_input: Callable
    backward_input_first: Callable
    weight: Callable


def _build(stage_fn: Callable, loss_fn: Callable, first_fn: Callable | None, remat: bool,
           pieces: StagePieces | None, rows: int) -> ActionPrograms:
    def one(pc):
        return jax.tree.map(lambda a: a[0], pc)

    def lead(tree):  # one's inverse: the accumulators keep a leading dimension of 1
        return jax.tree.map(lambda a: a[None], tree)

    def embed(fp, inputs, row):
        mb = jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, row, rows, 0), inputs)
        return mb if first_fn is None else first_fn(fp, mb)

    def stage_forward(p, x):
        return (stage_fn(p, x), ()) if remat else pieces.forward(p, x)

    def head(lp, y, targets, row, m, acc):
        t = jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, row, rows, 0), targets)

        def scaled_loss(lp, y):
            return loss_fn(lp, y, t).astype(jnp.float32) / m

        loss, (g_last, dy) = jax.value_and_grad(scaled_loss, argnums=(0, 1))(lp, y)
        return add_grads(acc, lead((loss, g_last))), dy  # the loss as [1]

    def forward(pc, x):
        return stage_forward(one(pc), x)

    def forward_first(pc, fp, inputs, row):
        x = embed(fp, inputs, row)
        return (x, *stage_forward(one(pc), x))

    def forward_last(pc, lp, x, targets, row, m, acc):
        y, res = stage_forward(one(pc), x)
        acc, dy = head(lp, y, targets, row, m, acc)
        return acc, dy, res

    def forward_first_last(pc, fp, lp, inputs, targets, row, m, acc):
        x = embed(fp, inputs, row)
        return (x, *forward_last(pc, lp, x, targets, row, m, acc))

    def whole_backward(p, x, dy, res, g):
        """``(dx, g + dp)``: one backward making both gradients, sharing what both read."""
        if remat:
            dp, dx = jax.vjp(stage_fn, p, x)[1](dy)
        else:
            dp, dx, _ = pieces.backward(p, x, dy, res)
        return dx, add_grads(g, lead(dp))

    def input_backward(p, x, dy, res):
        if remat:
            return jax.vjp(lambda x: stage_fn(p, x), x)[1](dy)[0], ()
        _, dx, wres = pieces.backward(p, x, dy, res)
        return dx, wres

    def embed_grad(fp, dx, inputs, row, gf):
        if first_fn is None:
            return gf
        mb = jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, row, rows, 0), inputs)
        (de,) = jax.vjp(lambda fp: first_fn(fp, mb), fp)[1](dx)
        return add_grads(gf, lead(de))

    def backward(pc, x, dy, res, g):
        return whole_backward(one(pc), x, dy, res, g)

    def backward_first(pc, fp, x, dy, res, g, gf, inputs, row):
        dx, g = whole_backward(one(pc), x, dy, res, g)
        return g, embed_grad(fp, dx, inputs, row, gf)

    def backward_input(pc, x, dy, res):
        return input_backward(one(pc), x, dy, res)

    def backward_input_first(pc, fp, x, dy, res, gf, inputs, row):
        dx, wres = input_backward(one(pc), x, dy, res)
        return wres, embed_grad(fp, dx, inputs, row, gf)

    def weight_of(g, p, x, dy, res, wres, go):
        if remat:
            return add_grads(g, lead(jax.vjp(lambda q: stage_fn(q, x), p)[1](dy)[0]))
        if g is None:
            return lead(pieces.weight(p, x, dy, res, wres))
        return lead(pieces.weight_into(one(g), p, x, dy, res, wres, go=go))

    def weight(g, pc, x, dy, res, wres, go):
        return weight_of(g, one(pc), x, dy, res, wres, go)

    jit = jax.jit
    return ActionPrograms(
        forward=jit(forward),
        forward_first=jit(forward_first),
        forward_last=jit(forward_last, donate_argnums=(6,)),
        forward_first_last=jit(forward_first_last, donate_argnums=(7,)),
        backward=jit(backward, donate_argnums=(4,)),
        backward_first=jit(backward_first, donate_argnums=(5, 6)),
        backward_input=jit(backward_input),
        backward_input_first=jit(backward_input_first, donate_argnums=(5,)),
        weight=jit(weight, donate_argnums=(0,)),
    )


@functools.lru_cache(maxsize=32)
def _cached(stage_fn, loss_fn, first_fn, remat, split, stage_key, act_key, rows):
    pieces = None
    if not remat:
        structs = [jax.ShapeDtypeStruct(s, d) for s, d in stage_key[1]]
        acts = [jax.ShapeDtypeStruct(s, d) for s, d in act_key[1]]
        pieces = split_stage(stage_fn, jax.tree.unflatten(stage_key[0], structs),
                             jax.tree.unflatten(act_key[0], acts), split)
    return _build(stage_fn, loss_fn, first_fn, remat, pieces, rows)


def action_programs(
    stage_fn: Callable,
    loss_fn: Callable,
    first_fn: Callable | None,
    *,
    remat: bool,
    split_backward: bool,
    one_stage: Any,
    act: Any,
    rows: int,
) -> ActionPrograms:
    """The programs of one model, cached by functions, modes and shapes.

    Args:
        stage_fn: the repeated block, ``stage_fn(stage_params, x) -> y``.
        loss_fn: head + mean loss of a microbatch.
        first_fn: the embedding, or ``None``.
        remat: recompute the stage in the backward instead of keeping residuals.
        split_backward: cut the backward into ``B`` and ``W`` (zero-bubble schedules).
        one_stage: one stage's parameters (shape structs, no leading dimension).
        act: one activation (shape structs).
        rows: the rows of a microbatch (the batch dimension of ``act``'s source).
    """
    return _cached(stage_fn, loss_fn, first_fn, remat, split_backward, tree_key(one_stage),
                   tree_key(act), rows)
