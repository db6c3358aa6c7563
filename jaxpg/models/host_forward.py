"""A model's call from host code: one global batch in, the whole logits out.

The tokens ``(batch, seq)`` are the same on every process. On a laid-out model they are
split over the batch axes (replicated when the data-parallel degree does not divide the
batch) and, under cp, along the sequence in the load-balanced order (rank ``i`` holding
chunks ``i`` and ``2cp-1-i``, with those chunks' global positions); one jitted
``jaxpg.spmd`` program per model and batch form all-gathers the FSDP-split parameters
and runs the per-rank forward; the logits are put back in sequence order and gathered to
every process.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.context_parallel.chunks import all_positions
from jaxpg.models.layout import param_paths
from jaxpg.spmd_lowering import spmd

__all__ = ["host_logits", "gather_fsdp"]

API = "CausalLM (host call)"
_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def gather_fsdp(model: Any) -> None:
    """Per-rank code: all-gathers each FSDP-split parameter of ``model`` (a model merged
    inside the program, so its variables hold this rank's blocks) over the layout's
    ``fsdp_axes``, in place."""
    layout = model.layout
    if not layout.fsdp_dims:
        return
    params = param_paths(model)
    for path, dim in layout.fsdp_dims:
        var = params[path]
        var.set_value(lax.all_gather(var.get_value(), layout.fsdp_axes, axis=dim, tiled=True))


def _check_tokens(tokens: Any, positions: Any, config: Any) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{API}: tokens must be integer ids of shape (batch, seq); got "
                         f"{tokens.dtype} {tokens.shape}.")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= config.vocab_size):
        raise ValueError(f"{API}: token ids must lie in [0, vocab_size={config.vocab_size}); "
                         f"got ids from {tokens.min()} to {tokens.max()}.")
    if positions is None:
        positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    positions = np.broadcast_to(np.asarray(positions), tokens.shape)
    return tokens.astype(np.int32), positions.astype(np.int32)


def _program(model: Any, graphdef: Any, specs: Any, split_batch: bool) -> Any:
    layout = model.layout
    key = (split_batch,)
    programs = _PROGRAMS.setdefault(model, {})
    if key in programs:
        return programs[key]
    batch = (layout.batch_axes or None) if split_batch else None
    if isinstance(batch, tuple) and len(batch) == 1:
        batch = batch[0]
    cp = layout.cp_axis_name if layout.cp > 1 else None
    token_spec = P(batch, cp)

    def per_rank(state, tokens, positions):
        local = nnx.merge(graphdef, state)
        gather_fsdp(local)
        return local.forward(tokens, positions)

    program = jax.jit(spmd(per_rank, mesh=layout.mesh, in_specs=(specs, token_spec, token_spec),
                           out_specs=P(batch, cp, None)))
    programs[key] = program
    return program


def _plain_program(model: Any, graphdef: Any) -> Any:
    programs = _PROGRAMS.setdefault(model, {})
    if "plain" not in programs:
        programs["plain"] = jax.jit(
            lambda state, t, p: nnx.merge(graphdef, state).forward(t, p))
    return programs["plain"]


def _specs_of(state: Any) -> Any:
    def spec(x):
        sharding = getattr(x, "sharding", None)
        return sharding.spec if isinstance(sharding, NamedSharding) else P()

    return jax.tree.map(spec, state)


def host_logits(model: Any, tokens: Any, positions: Any = None) -> jax.Array:
    """The logits ``(batch, seq, vocab)`` of one global batch, from host code."""
    tokens, positions = _check_tokens(tokens, positions, model.config)
    graphdef, state = nnx.split(model)
    layout = model.layout
    if layout is None:
        return _plain_program(model, graphdef)(state, tokens, positions)
    b, s = tokens.shape
    order = None
    if layout.cp > 1:
        chunks = 2 * layout.cp
        if s % chunks:
            raise ValueError(f"{API}: under cp={layout.cp} the sequence is cut into "
                             f"2 * cp = {chunks} chunks; got seq={s}. Pad the sequence to a "
                             f"multiple of {chunks}.")
        order = all_positions(layout.cp, s // layout.cp, True)
        tokens, positions = tokens[:, order], positions[:, order]
    dp = layout.dims[0] * layout.dims[1]
    split_batch = b % dp == 0
    program = _program(model, graphdef, _specs_of(state), split_batch)
    batch = (layout.batch_axes or None) if split_batch else None
    if isinstance(batch, tuple) and len(batch) == 1:
        batch = batch[0]
    sharding = NamedSharding(layout.mesh, P(batch, layout.cp_axis_name if order is not None
                                               else None))
    glob = [jax.make_array_from_callback(a.shape, sharding, lambda i, a=a: a[i])
            for a in (tokens, positions)]
    out = program(state, *glob)
    if out.is_fully_addressable:
        logits = np.asarray(out)
    else:
        logits = np.asarray(multihost_utils.process_allgather(out, tiled=True))
    if order is not None:
        logits = logits[:, np.argsort(order)]
    return jnp.asarray(logits)
