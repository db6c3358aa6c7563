"""Stage-stacked parameters placed on the pipeline's mesh: stages over ``pp``, the rest
replicated (or split as tensor-parallel specs say)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.groups.resolve import resolve_mesh
from jaxpg.pipeline.api import StagedParams, check_param_specs

__all__ = ["place_pipeline_params", "put_copy"]


def place_pipeline_params(params: StagedParams | Any, mesh: Any, *, pp_axis: str = "pp",
                          param_specs: Any = None) -> Any:
    """Puts stage-stacked parameters on ``mesh``: stages ``P(pp_axis)``, the rest replicated.

    With one chunk per rank each device then holds exactly its own stage; with more,
    so does a stack in rank order (``to_rank_order``; pass ``stage_order="rank"`` to the
    step), while a model-order one is resharded by every step. Optimizer
    states made from the placed parameters (``optimizer.init``) inherit the placement.
    The result is a copy, so a train step that donates it leaves ``params`` intact.
    With ``param_specs`` (see ``pipeline_value_and_grad``) each array is also split as its
    spec says: a stage array ``P(pp_axis, *spec)``, the others by their spec. ``mesh``
    may also be a DeviceMesh or a HybridCommunicateGroup.
    """
    mesh = resolve_mesh(mesh, api="place_pipeline_params")
    staged = params if isinstance(params, StagedParams) else StagedParams(params)
    if param_specs is None:
        stage_sharding = NamedSharding(mesh, P(pp_axis))
        replicated = NamedSharding(mesh, P())
        placed = StagedParams(
            jax.tree.map(lambda a: put_copy(a, stage_sharding), staged.stages),
            jax.tree.map(lambda a: put_copy(a, replicated), staged.first),
            jax.tree.map(lambda a: put_copy(a, replicated), staged.last),
        )
    else:
        leaves, treedef = check_param_specs(param_specs, staged, mesh, pp_axis, None)
        specs = jax.tree.unflatten(treedef, leaves)
        specs = specs._replace(stages=jax.tree.map(lambda s: P(pp_axis, *s), specs.stages))
        placed = jax.tree.map(lambda a, s: put_copy(a, NamedSharding(mesh, s)), staged, specs)
    return placed if isinstance(params, StagedParams) else placed.stages


def put_copy(a: Any, sharding: NamedSharding) -> jax.Array:
    """A copy of ``a`` placed with ``sharding`` (``a`` itself is never donated away).

    On a mesh that spans processes every process passes the same values; they go through
    the host (numpy), because in jax 0.10.2 ``device_put`` of a one-device ``jax.Array``
    to a sharding replicated across processes makes an array whose shards cannot be read.
    """
    if sharding.is_fully_addressable:
        return jax.device_put(jnp.array(a, copy=True), sharding)
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        return jax.jit(lambda x: x, out_shardings=sharding)(a)
    return jax.device_put(np.array(a), sharding)
