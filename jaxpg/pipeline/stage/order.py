"""The order of a stage-stacked parameter array: model order or rank order.

The executor's loop reads a rank's stage parameters as ``[v, p, ...]`` (chunk, rank),
sharded ``P(None, 'pp')``: rank ``r`` holds the ``v`` stages it runs. Stage parameters
come in as one stack with leading dimension ``p * v``, in one of two orders:

* ``"model"`` (the default): entry ``s`` is stage ``s``. With one chunk per rank the
  ``P('pp')`` placement of this stack is exactly the loop's. With ``v > 1`` rank ``r``
  runs stages that are not contiguous (``r`` and ``r + p`` for interleaved 1F1B, ``r``
  and ``2p - 1 - r`` for ZB-V), so every call reshards the whole stack to the loop's
  order (an all-gather and an all-to-all) and the gradients back.
* ``"rank"``: entry ``r * v + c`` is the stage rank ``r`` runs as its chunk ``c``. The
  ``P('pp')`` placement of this stack puts each rank's own stages on it, and the loop
  reads them with a local reshape: nothing moves between devices. Gradients come back
  in the same order. Keep parameters and optimizer state in rank order across steps
  (``to_rank_order`` once, before ``place_pipeline_params`` / ``init_train_state``) and
  convert back with ``to_model_order`` to inspect or save them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxpg.pipeline.stage.params import StagedParams

__all__ = ["STAGE_ORDERS", "check_stage_order", "loop_view", "stacked", "to_model_order",
           "to_rank_order"]

#: The orders a stage stack may come in.
STAGE_ORDERS = ("model", "rank")


def check_stage_order(stage_order: Any) -> str:
    """Returns ``stage_order`` if it is one of :data:`STAGE_ORDERS`; raises otherwise."""
    if stage_order not in STAGE_ORDERS:
        raise ValueError(
            f"stage_order={stage_order!r} is not one of {STAGE_ORDERS}: pass 'model' for a "
            "stack in model order, or 'rank' for one made by to_rank_order."
        )
    return stage_order


def _model_to_loop(a: jax.Array, tt: Any) -> jax.Array:
    """Model-order stack ``[v p, ...]`` -> ``[v, p, ...]`` indexed by (chunk, rank)."""
    v, p = tt.num_chunks, tt.num_stages
    a = a.reshape(v, p, *a.shape[1:])  # loop layout: chunk c, rank r is stage c p + r
    if tt.layout == "v":  # chunk 1 of rank r is stage 2p - 1 - r: reverse its ranks
        a = jnp.concatenate([a[:1], a[1:, ::-1]])
    return a


def _loop_to_model(a: jax.Array, tt: Any) -> jax.Array:
    """The inverse of ``_model_to_loop``."""
    if tt.layout == "v":
        a = jnp.concatenate([a[:1], a[1:, ::-1]])
    return a.reshape(tt.num_chunks * tt.num_stages, *a.shape[2:])


def loop_view(a: jax.Array, tt: Any, stage_order: str) -> jax.Array:
    """A stage stack in ``stage_order`` as the loop reads it: ``[v, p, ...]``.

    Args:
        a: one leaf of the stage stack, leading dimension ``p * v``.
        tt: the timetable (its ``num_stages`` ``p``, ``num_chunks`` ``v`` and ``layout``).
        stage_order: ``"model"`` or ``"rank"``.
    """
    if stage_order == "rank":  # rank-major: a local reshape of each rank's own block
        return jnp.swapaxes(a.reshape(tt.num_stages, tt.num_chunks, *a.shape[1:]), 0, 1)
    return _model_to_loop(a, tt)


def stacked(a: jax.Array, tt: Any, stage_order: str) -> jax.Array:
    """The inverse of :func:`loop_view`: ``[v, p, ...]`` -> a stack in ``stage_order``."""
    if stage_order == "rank":
        return jnp.swapaxes(a, 0, 1).reshape(tt.num_stages * tt.num_chunks, *a.shape[2:])
    return _loop_to_model(a, tt)


def _map_stages(params: Any, fn: Any) -> Any:
    if isinstance(params, StagedParams):
        return params._replace(stages=jax.tree.map(fn, params.stages))
    return jax.tree.map(fn, params)


def _check_stack(params: Any, tt: Any) -> None:
    stages = params.stages if isinstance(params, StagedParams) else params
    want = tt.num_stages * tt.num_chunks
    counts = {jnp.shape(a)[0] if jnp.ndim(a) else 0 for a in jax.tree.leaves(stages)}
    if counts != {want}:
        raise ValueError(
            f"the stage stack has leading dimensions {sorted(counts)}, but timetable "
            f"{tt.name!r} runs p * v = {tt.num_stages} * {tt.num_chunks} = {want} stages."
        )


def to_rank_order(params: Any, timetable: Any) -> Any:
    """A model-order stage stack in rank order (entry ``r * v + c``: rank ``r``'s chunk ``c``).

    Args:
        params: a ``StagedParams`` (its ``stages`` are reordered; ``first`` and ``last``
            kept) or a pytree of stage-stacked arrays, in model order.
        timetable: the schedule's ``Timetable`` (``get_schedule(name, p, m, v)``).

    Returns:
        The same structure, its stage stacks in rank order; pass ``stage_order="rank"``
        to ``pipeline_value_and_grad`` or ``make_train_step`` with it.
    """
    _check_stack(params, timetable)
    return _map_stages(params, lambda a: stacked(_model_to_loop(a, timetable), timetable,
                                                 "rank"))


def to_model_order(params: Any, timetable: Any) -> Any:
    """The inverse of :func:`to_rank_order`."""
    _check_stack(params, timetable)
    return _map_stages(params, lambda a: _loop_to_model(loop_view(a, timetable, "rank"),
                                                        timetable))
