"""One pipeline tick's work on one rank: the branches the executor switches between.

The executor keeps the rank's slot buffers (stage inputs ``act``, output gradients
``grad`` and, without remat, the residuals ``res`` of ``F`` and ``wres`` of ``B``)
*outside* the ``lax.switch``: it reads the tick's slots, hands the slot values to the
branch, and writes what the branch returns back into one slot (``write_slot``). A
branch therefore only ever sees one microbatch's arrays, and XLA does not copy whole
buffers through the conditional each tick. Only the accumulators (``g_stages``
``[v, ...]``, ``g_first``, ``g_last`` and the ``loss``) go through the switch.

* ``F*``: the forward of one stage on one microbatch; ``F_first`` embeds the
  microbatch (returned as the stage input to save), ``F_last`` applies head + loss
  and returns ``d(loss / m) / dy`` as the stage's output gradient to save. Without
  remat the forward also returns its residuals (``jaxpg.pipeline.stage_split``).
* ``B*``: the backward: the input and weight gradient (``B``) or the input gradient
  only (``B_input``, split schedules, which returns what ``W`` needs); ``*_first``
  also pulls the input gradient through the embedding. Without remat it runs from the
  saved residuals; with remat it recomputes the stage from its input (``jax.vjp``).
* ``W``: the weight gradient of a split backward: from the residuals of ``F`` and of
  ``B`` without remat (no recomputation), else by recomputing the stage again.

Every branch returns ``(acc, TickOut)``; ``TickOut.message`` is the one activation or
gradient the action sends (zeros when it sends nothing), routed by the buffer plan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxpg.pipeline.stage_split import StagePieces

__all__ = ["TickIn", "TickOut", "read_slot", "slot_buffers", "tick_branches", "write_slot",
           "writes"]  # fmt: skip


class TickIn(NamedTuple):
    """The slot values a branch reads: stage input, output gradient, residuals."""

    x: Any
    dy: Any
    res: Any
    wres: Any


class TickOut(NamedTuple):
    """What a branch returns besides the accumulators; unused fields hold zeros."""

    message: Any  # sent to the neighbour (activation or input gradient)
    act: Any  # F_first: the embedded stage input, saved in the act slot
    grad: Any  # F_last: d(loss / m) / dy, saved in the grad slot
    res: Any  # F without remat: residuals, saved in the res slot (= act slot)
    wres: Any  # B_input without remat: W's residuals, saved in the wres slot (= grad slot)


def writes(name: str, remat: bool) -> tuple[bool, bool, bool, bool]:
    """Whether branch ``name`` writes ``(act, grad, res, wres)``."""
    forward = name.startswith("F")
    return (
        name.startswith("F_first"),
        name in ("F_last", "F_first_last"),
        forward and not remat,
        name.startswith("B_input") and not remat,
    )


def read_slot(buf, slot):
    """One slot of a buffer (a pytree of arrays with a leading slot dimension)."""
    return jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, slot, 0, keepdims=False), buf)


def write_slot(buf, slot, value):
    """Writes ``value`` into ``slot``; slot ``-1`` means the buffer's last, spare slot."""
    def one(b, x):
        return lax.dynamic_update_index_in_dim(b, x, jnp.where(slot >= 0, slot, b.shape[0] - 1), 0)

    return jax.tree.map(one, buf, value)


def slot_buffers(structs: Any, num_slots: int) -> Any:
    """Zero buffers of ``num_slots`` slots plus one spare slot that absorbs no-op writes."""
    return jax.tree.map(lambda s: jnp.zeros((num_slots + 1, *s.shape), s.dtype), structs)


def _add_at(grads, index, delta):
    # A traced index on purpose: with constant ones (one branch per chunk) XLA's CPU
    # backend copied the accumulator in every other branch of the switch.
    return jax.tree.map(
        lambda g, d: lax.dynamic_update_index_in_dim(
            g, lax.dynamic_index_in_dim(g, index, 0, keepdims=False) + d, index, 0
        ),
        grads,
        delta,
    )


def _zeros(structs):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), structs)


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

    Each branch maps ``(acc, microbatch, chunk, TickIn)`` to ``(acc, TickOut)``.

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
    zeros = _zeros(act_struct)
    no_res = _zeros(pieces.res_structs) if pieces is not None else ()
    no_wres = _zeros(pieces.wres_structs) if pieces is not None else ()
    nothing = TickOut(zeros, zeros, zeros, no_res, no_wres)

    def chunk_params(c):
        return read_slot(stages, c)

    def embed(mb):
        x = read_slot(inputs, mb)
        return x if first_fn is None else first_fn(first_p, x)

    def forward(first: bool, last: bool):
        def run(acc, mb, c, io: TickIn):
            x = embed(mb) if first else io.x
            out = nothing._replace(act=x) if first else nothing
            if pieces is None:
                y = stage_fn(chunk_params(c), x)
            else:
                y, res = pieces.forward(chunk_params(c), x)
                out = out._replace(res=res)
            if not last:
                return acc, out._replace(message=y)

            def scaled_loss(lp, y):
                return loss_fn(lp, y, read_slot(targets, mb)).astype(jnp.float32) / m

            loss, (g_last, dy) = jax.value_and_grad(scaled_loss, argnums=(0, 1))(last_p, y)
            acc = dict(acc, loss=acc["loss"] + loss)
            acc["g_last"] = jax.tree.map(jnp.add, acc["g_last"], g_last)
            return acc, out._replace(grad=dy)

        return run

    def backward(first: bool, mode: str):
        def run(acc, mb, c, io: TickIn):
            acc, out = dict(acc), nothing
            x, dy, pc = io.x, io.dy, chunk_params(c)
            if pieces is not None:
                if mode == "weight":
                    dp = pieces.weight(pc, x, dy, io.res, io.wres)
                else:
                    dp, dx, wres = pieces.backward(pc, x, dy, io.res)
                    if mode == "input":
                        out = out._replace(wres=wres)
            elif mode == "full":
                dp, dx = jax.vjp(stage_fn, pc, x)[1](dy)
            elif mode == "input":
                (dx,) = jax.vjp(lambda x: stage_fn(pc, x), x)[1](dy)
            else:
                (dp,) = jax.vjp(lambda q: stage_fn(q, x), pc)[1](dy)
            if mode != "input":
                acc["g_stages"] = _add_at(acc["g_stages"], c, dp)
            if mode == "weight":
                return acc, out
            if first:
                if first_fn is not None:
                    inp = read_slot(inputs, mb)
                    (de,) = jax.vjp(lambda fp: first_fn(fp, inp), first_p)[1](dx)
                    acc["g_first"] = jax.tree.map(jnp.add, acc["g_first"], de)
                return acc, out
            return acc, out._replace(message=dx)

        return run

    table = {
        "idle": lambda acc, *_: (acc, nothing),
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
