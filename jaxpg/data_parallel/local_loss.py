"""One rank's loss in a data-parallel step, from a Flax NNX model or a parameter pytree."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def local_loss(loss_fn, graphdef: Any, params: Any, rest: Any, batch: Any,
               has_aux: bool) -> tuple[Any, tuple[Any, Any]]:
    """Per-rank ``(loss, (aux, new_rest))``.

    ``graphdef`` None means ``params`` is a plain pytree (Linen's): ``loss_fn(params,
    batch)``; otherwise ``loss_fn(model, batch)`` on the merged NNX model, whose non-parameter
    state (batch statistics, counters) comes back as ``new_rest``.

    Raises:
        ValueError: if the loss is not a scalar.
    """
    if graphdef is None:
        out, new_rest = loss_fn(params, batch), rest
    else:
        from flax import nnx

        # copy=True: fresh Variables at this trace level, so the module may update them.
        model = nnx.merge(graphdef, params, rest, copy=True)
        out = loss_fn(model, batch)
        new_rest = nnx.split(model, nnx.Param, ...)[2]
    loss, aux = out if has_aux else (out, None)
    loss = jnp.asarray(loss)
    if loss.shape != ():
        raise ValueError(
            f"loss_fn must return a scalar loss (the mean over this rank's batch); it returned "
            f"shape {loss.shape}. Reduce it with .mean(), or pass has_aux=True to return "
            "(loss, aux)."
        )
    return loss, (aux, new_rest)
