"""One FSDP unit's forward and backward inside the step: gather, compute, reshard.

:meth:`StepContext.call_unit` runs a unit's ``__call__`` as one ``jax.custom_vjp``:

* **forward**: all-gather the unit's parameters (after the unit's input exists: each
  shard is offset by ``0 * x[0]``, a data dependency that keeps XLA from hoisting every
  unit's gather to the start of the step), run the unit, and keep the vjp residuals;
* **reshard after forward** (``reshard_after_forward=True``): the gathered parameters are
  taken out of the residuals, so only the activations live until the backward;
* **backward**: all-gather the parameters again (after the unit's output cotangent
  exists, so the gather happens right before this unit's backward and not in the
  forward, where XLA would merge it with the first one), apply the vjp, and
  reduce-scatter the parameter gradients (:func:`~jaxpg.fsdp.collectives.reduce_leaf`).

``jax.checkpoint`` with a policy that recomputes only the gather cannot do this on
XLA:CPU: its optimization barrier is removed there and the recomputed all-gather is
merged with the forward one (measured: the temporary memory grew with depth). The
residual stripping keeps every activation from the forward (no recompute) and drops the
gathered parameters *as they are*: a parameter copied inside the unit (``w.T``,
``w.astype(...)``) is an activation to JAX and stays until the backward; cast with the
mixed-precision policy instead, which casts before the gather.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpg.fsdp.collectives import Comm, accumulate, gather_leaf, reduce_leaf

__all__ = ["StepContext"]


def _token(tree: Any) -> jax.Array | None:
    """``0`` as a float32 scalar that depends on the first array of ``tree`` (or None)."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and leaf.size and leaf.dtype != jax.dtypes.float0 \
                and not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            x = leaf.reshape(-1)[0].astype(jnp.float32)
            return jnp.where(jnp.isfinite(x), x, 0.0) * 0.0
    return None


def _after(shard: jax.Array, token: jax.Array | None) -> jax.Array:
    return shard if token is None else shard + token.astype(shard.dtype)


def _reject_graph_nodes(tree: Any, unit: str) -> None:
    from flax import nnx

    def is_node(x):
        return isinstance(x, nnx.Variable) or nnx.graph.is_graph_node(x)

    for leaf in jax.tree.leaves(tree, is_leaf=is_node):
        if is_node(leaf):
            raise TypeError(
                f"FullyShardedDataParallel: unit {unit!r} was called with an NNX object "
                f"({type(leaf).__name__}) as an argument; pass arrays and static Python "
                "values to units, and keep modules and RNG streams as attributes."
            )


class StepContext:
    """What the units of one traced step need; active while ``loss_fn`` is traced.

    Args:
        comm: the collectives' static facts.
        stage: 1, 2 or 3 (only stage 3 gathers inside units).
        reshard_after_forward: drop gathered parameters between forward and backward.
        unit_layouts: unit path -> its parameters' ``LeafSplit`` leaves, in the order
            ``nnx.split(unit, nnx.Param)`` flattens them.
        unit_accs: unit path -> its ``no_sync`` accumulators (same order), or None.
        no_sync: gradients are accumulated, not reduced.
    """

    def __init__(self, comm: Comm, *, stage: int, reshard_after_forward: bool,
                 unit_layouts: dict[str, list[Any]], unit_accs: dict[str, list[Any]] | None,
                 no_sync: bool):
        self.comm = comm
        self.stage = stage
        self.reshard = reshard_after_forward
        self.unit_layouts = unit_layouts
        self.unit_accs = unit_accs
        self.no_sync = no_sync

    def call_unit(self, unit: str, module: Any, fn: Callable[..., Any], args: tuple,
                  kwargs: dict) -> Any:
        """Runs ``fn(module, *args, **kwargs)`` for unit ``unit`` ('' is the root)."""
        policy = self.comm.policy
        if unit == "" or self.stage < 3:  # parameters already whole: only the casts
            args, kwargs = policy.cast_inputs((args, kwargs))
            return policy.cast_outputs(fn(module, *args, **kwargs))
        return self._sharded_call(unit, module, fn, args, kwargs)

    def _sharded_call(self, unit, module, fn, args, kwargs):
        from flax import nnx

        _reject_graph_nodes((args, kwargs), unit)
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        shards, p_def = jax.tree.flatten(params)
        layouts = self.unit_layouts[unit]
        accs = self.unit_accs[unit] if self.unit_accs is not None else None
        rest_leaves, rest_def = jax.tree.flatten(rest)
        arg_leaves, arg_def = jax.tree.flatten((args, kwargs))
        dyn_at = [i for i, x in enumerate(arg_leaves) if isinstance(x, jax.Array | np.ndarray)]
        comm, policy, reshard, no_sync = self.comm, self.comm.policy, self.reshard, self.no_sync

        def pure(full, rest_in, dyn):
            leaves = list(arg_leaves)
            for i, v in zip(dyn_at, dyn, strict=True):
                leaves[i] = v
            a, kw = policy.cast_inputs(jax.tree.unflatten(arg_def, leaves))
            m = nnx.merge(graphdef, jax.tree.unflatten(p_def, full),
                          jax.tree.unflatten(rest_def, rest_in))
            out = policy.cast_outputs(fn(m, *a, **kw))
            for leaf in jax.tree.leaves(out):
                if not isinstance(leaf, jax.Array):
                    raise TypeError(
                        f"FullyShardedDataParallel: unit {unit!r} returned a "
                        f"{type(leaf).__name__}; a unit's outputs must be arrays (or "
                        "pytrees of arrays)."
                    )
            return out, jax.tree.leaves(nnx.split(m, nnx.Param, ...)[2])

        def gather_all(shards_in, token):
            return [gather_leaf(_after(s, token), lay, comm)
                    for s, lay in zip(shards_in, layouts, strict=True)]

        cell: dict[str, Any] = {}

        @jax.custom_vjp
        def call(shards_in, accs_in, rest_in, dyn):
            return pure(gather_all(shards_in, None), rest_in, dyn)

        def fwd(shards_in, accs_in, rest_in, dyn):
            full = gather_all(shards_in, _token(dyn))
            out, vjp_fn = jax.vjp(pure, full, rest_in, dyn)
            residuals, res_def = jax.tree.flatten(vjp_fn)
            index = {id(f): i for i, f in enumerate(full)} if reshard else {}
            where = [index.get(id(r)) for r in residuals]
            cell["res_def"], cell["where"] = res_def, where
            kept = [r for r, w in zip(residuals, where, strict=True) if w is None]
            return out, (shards_in, accs_in, kept)

        def bwd(res, ct):
            shards_in, accs_in, kept = res
            where = cell["where"]
            full = gather_all(shards_in, _token(ct)) if any(w is not None for w in where) else []
            it = iter(kept)
            residuals = [next(it) if w is None else full[w] for w in where]
            g_full, g_rest, g_dyn = jax.tree.unflatten(cell["res_def"], residuals)(ct)
            if no_sync:
                g_shards = [None] * len(g_full)
                g_accs = [g.astype(a.dtype) for g, a in zip(g_full, accs_in, strict=True)]
            else:
                acc_list = accs_in if accs_in is not None else [None] * len(g_full)
                g_shards = [reduce_leaf(accumulate(g, a), lay, comm)
                            for g, a, lay in zip(g_full, acc_list, layouts, strict=True)]
                g_accs = None if accs_in is None else [None] * len(accs_in)
            return g_shards, g_accs, g_rest, g_dyn

        call.defvjp(fwd, bwd)
        if len(shards) != len(layouts):
            raise RuntimeError(f"FSDP unit {unit!r}: {len(shards)} parameters, "
                               f"{len(layouts)} layouts; the model changed after wrapping.")
        out, new_rest = call(shards, accs, rest_leaves, [arg_leaves[i] for i in dyn_at])
        nnx.update(module, jax.tree.unflatten(rest_def, new_rest))
        return out
