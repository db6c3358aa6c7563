"""One pipeline tick's work on one rank: the branches the executor switches between.

The state each branch reads and returns is a dict with the rank's activation buffer
``act`` (stage inputs), gradient buffer ``grad`` (output gradients), the accumulated
gradients ``g_stages`` (``[v, ...]``), ``g_first``, ``g_last`` and the ``loss``; without
remat also ``res`` (the forward's saved residuals, one entry per ``act`` slot) and, for
split schedules, ``wres`` (what ``B`` saves for ``W``, one entry per ``grad`` slot).

* ``F*``: the forward of one stage on one microbatch; ``F_first`` embeds the
  microbatch and saves the result as the stage input, ``F_last`` applies head + loss
  and saves ``d(loss / m) / dy`` as the stage's output gradient. Without remat the
  forward also saves its residuals (``jaxpg.pipeline.stage_split``).
* ``B*``: the backward: the input and weight gradient (``B``) or the input gradient
  only (``B_input``, split schedules); ``*_first`` also pulls the input gradient
  through the embedding. Without remat it runs from the saved residuals; with remat it
  recomputes the stage from its saved input (``jax.vjp``).
* ``W``: the weight gradient of a split backward: from the residuals of ``F`` and of
  ``B`` without remat (no recomputation), else by recomputing the stage again.

Every branch returns ``(state, message)``: the one activation or gradient the action
sends (zeros when it sends nothing); the executor routes it by the buffer plan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxpg.pipeline.stage_split import StagePieces

__all__ = ["tick_branches", "store", "slot_buffers"]


def _read(buf, slot):
    return jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, slot, 0, keepdims=False), buf)


def _write(buf, slot, value):
    return jax.tree.map(lambda b, x: lax.dynamic_update_index_in_dim(b, x, slot, 0), buf, value)


def store(buf, slot, value):
    """Writes ``value`` into ``slot`` when ``slot >= 0``; otherwise leaves ``buf`` as is."""
    safe = jnp.maximum(slot, 0)
    kept = _read(buf, safe)
    return _write(buf, safe, jax.tree.map(lambda x, k: jnp.where(slot >= 0, x, k), value, kept))


def slot_buffers(structs: Any, num_slots: int) -> Any:
    """Zero buffers with a leading slot dimension for a pytree of shape structs."""
    return jax.tree.map(lambda s: jnp.zeros((num_slots, *s.shape), s.dtype), structs)


def _add_at(grads, index, delta):
    return jax.tree.map(
        lambda g, d: lax.dynamic_update_index_in_dim(
            g, lax.dynamic_index_in_dim(g, index, 0, keepdims=False) + d, index, 0
        ),
        grads,
        delta,
    )


def tick_branches(
    stage_fn: Callable,
    loss_fn: Callable,
    first_fn: Callable | None,
    num_microbatches: int,
    names: tuple[str, ...],
    act_struct: Any,
    params: tuple[Any, Any, Any],
    inputs: Any,
    targets: Any,
    pieces: StagePieces | None = None,
) -> list[Callable]:
    """Builds one ``lax.switch`` branch per name in ``names`` (see ``BRANCHES``).

    Each branch maps ``(state, microbatch, chunk, act_slot, grad_slot)`` to
    ``(state, message)``; the message is zeros when the action sends nothing.

    Args:
        stage_fn: the repeated block.
        loss_fn: head + mean loss of a microbatch.
        first_fn: the embedding, or ``None``.
        num_microbatches: ``m``; the loss and its gradient are scaled by ``1 / m``.
        names: the branch names the buffer plan uses.
        act_struct: one activation, a pytree of ``jax.ShapeDtypeStruct``.
        params: this rank's ``(stages [v, ...], first, last)`` parameters.
        inputs: this rank's inputs split into microbatches ``[m, b, ...]``.
        targets: this rank's targets split into microbatches.
        pieces: the stage cut into F/B/W pieces (``split_stage``) to keep residuals
            instead of recomputing; ``None`` for stage-input remat.
    """
    m = num_microbatches
    stages, first_p, last_p = params
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), act_struct)

    def pick(tree, i):
        return _read(tree, i)

    def embed(mb):
        x = pick(inputs, mb)
        return x if first_fn is None else first_fn(first_p, x)

    def forward(first: bool, last: bool):
        def run(state, mb, c, a, g):
            state = dict(state)
            if first:
                x = embed(mb)
                state["act"] = _write(state["act"], a, x)
            else:
                x = _read(state["act"], a)
            if pieces is None:
                y = stage_fn(pick(stages, c), x)
            else:
                y, res = pieces.forward(pick(stages, c), x)
                state["res"] = _write(state["res"], a, res)
            if not last:
                return state, y

            def scaled_loss(lp, y):
                return loss_fn(lp, y, pick(targets, mb)).astype(jnp.float32) / m

            loss, (g_last, dy) = jax.value_and_grad(scaled_loss, argnums=(0, 1))(last_p, y)
            state["loss"] = state["loss"] + loss
            state["g_last"] = jax.tree.map(jnp.add, state["g_last"], g_last)
            state["grad"] = _write(state["grad"], g, dy)
            return state, zeros

        return run

    def backward(first: bool, mode: str):
        def run(state, mb, c, a, g):
            state = dict(state)
            x, dy, pc = _read(state["act"], a), _read(state["grad"], g), pick(stages, c)
            if pieces is not None:
                res = _read(state["res"], a)
                if mode == "weight":
                    dp = pieces.weight(pc, x, dy, res, _read(state["wres"], g))
                else:
                    dp, dx, wres = pieces.backward(pc, x, dy, res)
                    if mode == "input":
                        state["wres"] = _write(state["wres"], g, wres)
            elif mode == "full":
                dp, dx = jax.vjp(stage_fn, pc, x)[1](dy)
            elif mode == "input":
                (dx,) = jax.vjp(lambda x: stage_fn(pc, x), x)[1](dy)
            else:
                (dp,) = jax.vjp(lambda q: stage_fn(q, x), pc)[1](dy)
            if mode != "input":
                state["g_stages"] = _add_at(state["g_stages"], c, dp)
            if mode == "weight":
                return state, zeros
            if first:
                if first_fn is not None:
                    inp = pick(inputs, mb)
                    (de,) = jax.vjp(lambda fp: first_fn(fp, inp), first_p)[1](dx)
                    state["g_first"] = jax.tree.map(jnp.add, state["g_first"], de)
                return state, zeros
            return state, dx

        return run

    table = {
        "idle": lambda state, *_: (state, zeros),
        "F": forward(False, False),
        "F_first": forward(True, False),
        "F_last": forward(False, True),
        "F_first_last": forward(True, True),
        "B": backward(False, "full"),
        "B_first": backward(True, "full"),
        "B_input": backward(False, "input"),
        "B_input_first": backward(True, "input"),
        "W": backward(False, "weight"),
    }
    return [table[name] for name in names]
