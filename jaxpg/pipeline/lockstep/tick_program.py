"""One pipeline tick's work on one rank, as a chain of two-way conditionals.

A tick runs at most one action per rank. The executor runs the three steps made here
in turn, each under its own two-way ``lax.cond`` on the tick's action kind (the other
two pass the state through):

* ``forward``: the stage's forward on one microbatch. The first model stage embeds the
  microbatch and saves it as the stage input; without remat the residuals of the
  stage (``jaxpg.pipeline.stage.split``) are saved in the ``res`` slot; the last model
  stage applies head + loss, adds to ``loss`` and ``g_last`` and saves
  ``d(loss / m) / dy`` in its output-gradient slot. The message is the stage output.
* ``backward``: the input gradient (the message). A whole backward also adds the
  weight gradient to the chunk's accumulator; a split one (``B`` of ZB-H1, ZB-V)
  saves what ``W`` needs in the ``wres`` slot. The first model stage pulls the input
  gradient through the embedding into ``g_first``. Without remat it runs from the
  saved residuals; with remat it recomputes the stage from its input (``jax.vjp``).
* ``weight`` (split schedules): the weight gradient, from the residuals of ``F`` and
  ``B`` (or, with remat, by recomputing the stage), added to the chunk's accumulator.

The state (slot buffers, accumulators, the message) is a dict. Each step declares the
entries it writes (``TickStep.writes``); only those are its cond's operands-and-results,
updated in place (``dynamic_update_slice``, ``+``), and the rest are read-only operands.
Why not one ``lax.switch`` over the action kinds: XLA copies every output of a
conditional with more than two branches in every branch (its copy insertion makes them
phis and cannot elide the copies), so state carried through a switch, a weight-gradient
accumulator above all, is copied whole on every tick; a two-way cond that updates its
operand or passes it through has both copies elided. A buffer a step only reads is not
one of its outputs, so XLA need not keep a copy of it for the step. The steps read only
the slots they need and write nothing they do not make (no zero-filled outputs).

``W`` adds its weight gradients to the accumulator one at a time
(``StagePieces.weight_into``): made all at once, as XLA schedules independent matmuls,
every weight gradient of the stage is a live temporary together (16 MB for two
512 x 2048 blocks); one at a time, ZB-H1's compiled temp memory at width 512, p = 4
fell from 36.9 MB to 26.3 MB, and with it the fresh pages each call faults in (XLA:CPU
allocates a program's temp buffer on every call).

Accumulators per chunk are separate (one pytree per chunk, no chunk dimension), each
updated under its own two-way cond; a stage's parameters for chunk ``c`` are picked by
a ``lax.switch`` over per-chunk trees sliced once before the loop, whose branches return
only activation-sized values. Slicing the ``[v, ...]`` stacks per tick instead would
make XLA:CPU copy the chunk's weights and accumulator on every use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxpg.pipeline.lockstep import buffer_plan as cols
from jaxpg.pipeline.stage.split import StagePieces

__all__ = [
    "KIND_OF", "TickStep", "TickSteps", "read_slot", "slot_buffers", "tick_steps", "write_slot",
]

#: Action kind of each branch name: 0 idle, 1 forward, 2 backward, 3 weight gradient.
KIND_OF = {"idle": 0, "F": 1, "F_first": 1, "F_last": 1, "F_first_last": 1, "B": 2,
           "B_first": 2, "B_input": 2, "B_input_first": 2, "W": 3}  # fmt: skip


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


class TickStep(NamedTuple):
    """One step of a tick: ``run(state, op, flags) -> {key: value}`` for the keys in ``writes``.

    ``state`` is the executor's dict of slot buffers, accumulators and the message;
    ``op`` the rank's row of the buffer plan; ``flags`` ``(first, last)``: whether the
    action runs the first or last model stage. Only the ``writes`` entries are the
    step's cond outputs: the rest are read-only operands, which XLA need not copy.
    """

    run: Callable
    writes: tuple[str, ...]


class TickSteps(NamedTuple):
    """The ``forward``, ``backward`` and ``weight`` :class:`TickStep` of a tick."""

    forward: TickStep
    backward: TickStep
    weight: TickStep


def tick_steps(
    stage_fn: Callable,
    loss_fn: Callable,
    first_fn: Callable | None,
    num_microbatches: int,
    names: tuple[str, ...],
    params: tuple[Any, Any, Any],
    inputs: Any,
    targets: Any,
    pieces: StagePieces | None = None,
) -> TickSteps:
    """Builds the steps of a tick for the branch ``names`` of a buffer plan.

    Args:
        stage_fn: the repeated block.
        loss_fn: head + mean loss of a microbatch.
        first_fn: the embedding, or ``None``.
        num_microbatches: ``m``; the loss and its gradient are scaled by ``1 / m``.
        names: the branch names the buffer plan uses (which variants can occur).
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
    if v > 1:  # slice once, here: else XLA sinks the slices into the branches (a copy a tick)
        chunks = lax.optimization_barrier(chunks)
    remat = pieces is None
    split = "W" in names
    first_forward = any(n in ("F_first", "F_first_last") for n in names)
    last_forward = any(n in ("F_last", "F_first_last") for n in names)
    first_backward = first_fn is not None and any(
        n in ("B_first", "B_input_first") for n in names
    )

    def on_chunk(c, fn, *args):
        """``fn(chunk_params, *args)`` for chunk ``c``; ``fn`` returns activation-sized values."""
        if v == 1:
            return fn(chunks[0], *args)
        return lax.switch(c, [lambda *a, pc=pc: fn(pc, *a) for pc in chunks], *args)

    def add_to_chunk(g_stages, c, grad_fn, *args, into=None):
        """``g_stages[c] += dp`` for ``(dp, extra) = grad_fn(chunk_params, *args)``.

        ``into(g, chunk_params, *args) -> (g + dp, extra)``, if given, does the addition
        itself (``StagePieces.weight_into``). Returns ``(g_stages, extra)``; each chunk's
        accumulator is updated under its own two-way cond, so no weight-sized value is
        ever a switch output.
        """
        out, extra = list(g_stages), None
        for i, pc in enumerate(chunks):

            def update(g, *a, pc=pc):
                if into is not None:
                    return into(g, pc, *a)
                dp, more = grad_fn(pc, *a)
                return jax.tree.map(jnp.add, g, dp), more

            if v == 1:
                out[i], extra = update(out[i], *args)
                continue
            skip_extra = jax.eval_shape(lambda *a, pc=pc: grad_fn(pc, *a)[1], *args)

            def skip(g, *a, skip_extra=skip_extra):
                return g, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), skip_extra)

            out[i], more = lax.cond(c == i, update, skip, out[i], *args)
            extra = more if extra is None else jax.tree.map(
                lambda u, w, i=i: jnp.where(c == i, u, w), more, extra
            )
        return out, extra

    def embed(mb):
        x = read_slot(inputs, mb)
        return x if first_fn is None else first_fn(first_p, x)

    def forward(state, op, flags):
        bufs = acc = dict(state)  # one dict: the step writes some of its entries
        first, last = flags
        mb, c, a, g = op[cols.MB], op[cols.CHUNK], op[cols.ACT], op[cols.GRAD]
        if first_forward:
            x = lax.cond(first, lambda: embed(mb), lambda: read_slot(bufs["act"], a))
            bufs["act"] = write_slot(bufs["act"], jnp.where(first, a, -1), x)
        else:
            x = read_slot(bufs["act"], a)
        if remat:
            y = on_chunk(c, stage_fn, x)
        else:
            y, res = on_chunk(c, pieces.forward, x)
            bufs["res"] = write_slot(bufs["res"], a, res)
        if last_forward:

            def head(acc_last, y):
                loss_acc, g_last_acc = acc_last

                def scaled_loss(lp, y):
                    return loss_fn(lp, y, read_slot(targets, mb)).astype(jnp.float32) / m

                loss, (g_last, dy) = jax.value_and_grad(scaled_loss, argnums=(0, 1))(last_p, y)
                return (loss_acc + loss, jax.tree.map(jnp.add, g_last_acc, g_last)), dy

            def no_head(acc_last, y):
                return acc_last, jax.tree.map(jnp.zeros_like, y)

            acc["last"], dy = lax.cond(last, head, no_head, state["last"], y)
            bufs["grad"] = write_slot(bufs["grad"], jnp.where(last, g, -1), dy)
        return _written(forward_writes, {**bufs, "message": y})

    def backward(state, op, flags):
        bufs = acc = dict(state)  # one dict: the step writes some of its entries
        first, _ = flags
        mb, c, a, g = op[cols.MB], op[cols.CHUNK], op[cols.ACT], op[cols.GRAD]
        x, dy = read_slot(bufs["act"], a), read_slot(bufs["grad"], g)
        if remat:
            if split:
                dx = on_chunk(
                    c, lambda pc, x, dy: jax.vjp(lambda x: stage_fn(pc, x), x)[1](dy)[0], x, dy
                )
            else:
                acc["g_stages"], dx = add_to_chunk(
                    acc["g_stages"], c, lambda pc, x, dy: jax.vjp(stage_fn, pc, x)[1](dy), x, dy
                )
        else:
            res = read_slot(bufs["res"], a)
            if split:
                dx, wres = on_chunk(c, lambda pc, *a: pieces.backward(pc, *a)[1:], x, dy, res)
                bufs["wres"] = write_slot(bufs["wres"], g, wres)
            else:  # one backward makes dp and dx, sharing what both read
                acc["g_stages"], dx = add_to_chunk(
                    acc["g_stages"], c, lambda pc, *a: pieces.backward(pc, *a)[:2], x, dy, res,
                )  # fmt: skip
        if first_backward:

            def embed_grad(g_first, dx):
                inp = read_slot(inputs, mb)
                (de,) = jax.vjp(lambda fp: first_fn(fp, inp), first_p)[1](dx)
                return jax.tree.map(jnp.add, g_first, de)

            acc["g_first"] = lax.cond(first, embed_grad, lambda g, _: g, acc["g_first"], dx)
        return _written(backward_writes, {**bufs, "message": dx})

    def weight(state, op, flags):
        bufs = acc = dict(state)  # one dict: the step writes some of its entries
        c, a, g = op[cols.CHUNK], op[cols.ACT], op[cols.GRAD]
        go = op[cols.BRANCH] >= 0  # always true, but traced: weight_into's conds stay conds
        x, dy = read_slot(bufs["act"], a), read_slot(bufs["grad"], g)
        if remat:
            acc["g_stages"], _ = add_to_chunk(
                acc["g_stages"], c,
                lambda pc, x, dy: (jax.vjp(lambda q: stage_fn(q, x), pc)[1](dy)[0], None), x, dy,
            )  # fmt: skip
        else:
            res, wres = read_slot(bufs["res"], a), read_slot(bufs["wres"], g)
            acc["g_stages"], _ = add_to_chunk(
                acc["g_stages"], c,
                lambda pc, *a: (pieces.weight(pc, *a), None), x, dy, res, wres,
                into=lambda g, pc, *a: (pieces.weight_into(g, pc, *a, go=go), None),
            )  # fmt: skip
        return _written(("g_stages",), acc)

    forward_writes = ("message",) + ("act",) * first_forward + ("res",) * (not remat) + (
        ("grad", "last") if last_forward else ()
    )
    backward_writes = ("message",) + ("wres",) * (split and not remat) + (
        ("g_stages",) if not split else ()
    ) + ("g_first",) * first_backward
    return TickSteps(
        TickStep(forward, forward_writes),
        TickStep(backward, backward_writes),
        TickStep(weight, ("g_stages",)),
    )


def _written(keys: tuple[str, ...], values: dict) -> dict:
    return {k: values[k] for k in keys}
