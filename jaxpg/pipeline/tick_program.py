"""One pipeline tick's work on one rank: the branches and the accumulator steps.

The executor keeps the rank's slot buffers (stage inputs ``act``, output gradients
``grad`` and, without remat, the residuals ``res`` of ``F`` and ``wres`` of ``B``)
*outside* the ``lax.switch``: it reads the tick's slots, hands the slot values to the
branch, and writes what the branch returns back into one slot (``write_slot``). A
branch therefore only ever sees one microbatch's arrays.

No accumulator goes through the ``lax.switch`` either. XLA copies every output of a
conditional with more than two branches in every branch (its copy insertion treats
them as phis and cannot elide the copies), so a weight-gradient accumulator carried
through the switch was copied whole on every tick. Each accumulator instead lives in
its own two-way ``lax.cond`` that either updates it in place or passes it through
(XLA elides both copies there), run after the switch:

* ``weight_step``: the stage weight gradient ``g_stages [v, ...]``, on ticks that run a
  whole backward ``B`` or a ``W``. Without remat it runs the weight piece of the split
  stage (``jaxpg.pipeline.stage_split``) from the residuals of ``F`` and ``B``; with
  remat it recomputes the stage (``jax.vjp``; for a whole ``B`` it also returns the
  input gradient, so the forward is recomputed once).
* ``head_step``: head + loss on the last stage's forward output: ``loss``, ``g_last``
  and the output gradient ``d(loss / m) / dy`` to save.
* ``embed_step``: the embedding's gradient on the first stage's backward: ``g_first``.

Branches of the switch (each maps ``(microbatch, chunk, TickIn)`` to a ``TickOut``):

* ``F*``: the forward of one stage on one microbatch; ``F_first`` embeds the
  microbatch (returned as the stage input to save). The output is the message (the
  last stage's goes to ``head_step`` and is stored nowhere). Without remat the forward
  also returns its residuals.
* ``B*`` and ``B_input*``: the input gradient (the message), and without remat what the
  weight piece needs (``wres``: saved for ``W`` by ``B_input``, handed straight to
  ``weight_step`` by a whole ``B``). With remat a whole ``B`` leaves all its work to
  ``weight_step``; ``B_input`` recomputes the stage for the input gradient.
* ``W``: hands the saved ``wres`` to ``weight_step``.

With ``v > 1`` chunks per rank, a branch picks its chunk's parameters with an inner
switch over per-chunk parameter trees (sliced once, before the loop) instead of
slicing the stacked parameters on every tick, which XLA:CPU would copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxpg.pipeline.stage_split import StagePieces

__all__ = ["TickIn", "TickOut", "TickProgram", "read_slot", "slot_buffers", "tick_program",
           "write_slot", "writes"]  # fmt: skip


class TickIn(NamedTuple):
    """The slot values a branch reads: stage input, output gradient, residuals."""

    x: Any
    dy: Any
    res: Any
    wres: Any


class TickOut(NamedTuple):
    """What a branch returns; unused fields hold zeros."""

    message: Any  # sent to the neighbour (activation or input gradient)
    act: Any  # F_first: the embedded stage input, saved in the act slot
    res: Any  # F without remat: residuals, saved in the res slot (= act slot)
    wres: Any  # B without remat: W's residuals (saved in the wres slot by B_input)


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


def _zeros(structs):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), structs)


class TickProgram(NamedTuple):
    """The pieces of a tick; see the module docstring.

    Attributes:
        branches: one ``(mb, chunk, TickIn) -> TickOut`` function per branch name.
        weight_steps: per chunk ``i``, ``(g_i, TickIn, TickOut) -> (g_i, dx)``: adds
            the chunk's weight gradient to its accumulator ``g_i`` (``dx``: a remat whole
            backward's input gradient, else zeros).
        head_step: ``((loss, g_last), mb, y) -> ((loss, g_last), dy)``.
        embed_step: ``(g_first, mb, dx) -> g_first``.
        skip_weight, skip_head, skip_embed: the pass-through branches of the same.
    """

    branches: list[Callable]
    weight_steps: list[Callable]
    skip_weight: Callable
    head_step: Callable
    skip_head: Callable
    embed_step: Callable
    skip_embed: Callable


def tick_program(
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
) -> TickProgram:
    """Builds the branches and accumulator steps for the branch ``names`` of a plan.

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
        pieces: the stage cut into F/B/W pieces (``split_stage(..., split_backward=True)``)
            to keep residuals instead of recomputing; ``None`` for stage-input remat.
    """
    m = num_microbatches
    stages, first_p, last_p = params
    v = jax.tree.leaves(stages)[0].shape[0]
    chunks = [jax.tree.map(lambda a, i=i: a[i], stages) for i in range(v)]
    zeros = _zeros(act_struct)
    no_res = _zeros(pieces.res_structs) if pieces is not None else ()
    no_wres = _zeros(pieces.wres_structs) if pieces is not None else ()
    nothing = TickOut(zeros, zeros, no_res, no_wres)
    remat = pieces is None
    split = any(n.startswith("B_input") or n == "W" for n in names)

    def on_chunk(c, fn, *args):
        """``fn(chunk_params, *args)`` for chunk ``c``, without slicing the stack."""
        if v == 1:
            return fn(chunks[0], *args)
        return lax.switch(c, [lambda *a, pc=pc: fn(pc, *a) for pc in chunks], *args)

    def embed(mb):
        x = read_slot(inputs, mb)
        return x if first_fn is None else first_fn(first_p, x)

    def forward(first: bool):
        def run(mb, c, io: TickIn):
            x = embed(mb) if first else io.x
            out = nothing._replace(act=x) if first else nothing
            if remat:
                return out._replace(message=on_chunk(c, stage_fn, x))
            y, res = on_chunk(c, pieces.forward, x)
            return out._replace(message=y, res=res)

        return run

    def backward(mb, c, io: TickIn):
        """The input gradient (and, without remat, W's residuals)."""
        if remat:
            if not split:  # a whole backward: weight_step does all of it
                return nothing
            dx = on_chunk(c, lambda pc, x, dy: jax.vjp(lambda x: stage_fn(pc, x), x)[1](dy)[0],
                          io.x, io.dy)  # fmt: skip
            return nothing._replace(message=dx)
        _, dx, wres = on_chunk(c, pieces.backward, io.x, io.dy, io.res)
        return nothing._replace(message=dx, wres=wres)

    table = {
        "idle": lambda *_: nothing,
        "F": forward(False),
        "F_first": forward(True),
        "F_last": forward(False),
        "F_first_last": forward(True),
        "B": backward,
        "B_first": backward,
        "B_input": backward,
        "B_input_first": backward,
        "W": lambda mb, c, io: nothing._replace(wres=io.wres),
    }

    def weight_step(chunk: int):
        """The weight gradient of chunk ``chunk`` added to its accumulator."""
        pc = chunks[chunk]

        def run(g, io: TickIn, out: TickOut):
            if not remat:
                dp = pieces.weight(pc, io.x, io.dy, io.res, out.wres)
                return jax.tree.map(jnp.add, g, dp), zeros
            if split:
                (dp,) = jax.vjp(lambda q: stage_fn(q, io.x), pc)[1](io.dy)
                return jax.tree.map(jnp.add, g, dp), zeros
            dp, dx = jax.vjp(stage_fn, pc, io.x)[1](io.dy)
            return jax.tree.map(jnp.add, g, dp), dx

        return run

    def head_step(acc, mb, y):
        loss_acc, g_last_acc = acc

        def scaled_loss(lp, y):
            return loss_fn(lp, y, read_slot(targets, mb)).astype(jnp.float32) / m

        loss, (g_last, dy) = jax.value_and_grad(scaled_loss, argnums=(0, 1))(last_p, y)
        return (loss_acc + loss, jax.tree.map(jnp.add, g_last_acc, g_last)), dy

    def embed_step(g_first, mb, dx):
        inp = read_slot(inputs, mb)
        (de,) = jax.vjp(lambda fp: first_fn(fp, inp), first_p)[1](dx)
        return jax.tree.map(jnp.add, g_first, de)

    return TickProgram(
        branches=[table[name] for name in names],
        weight_steps=[weight_step(i) for i in range(v)],
        skip_weight=lambda g, *_: (g, zeros),
        head_step=head_step,
        skip_head=lambda acc, *_: (acc, zeros),
        embed_step=embed_step,
        skip_embed=lambda g, *_: g,
    )
