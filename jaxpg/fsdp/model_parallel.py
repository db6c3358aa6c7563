"""FSDP over a model that tensor parallelism already split: torchtitan's 2-D mesh.

"Parallelize first, then shard": a model parallelized with
``jaxpg.tensor_parallel.parallelize_module(model, mesh["tp"], plan)`` on a ``("dp", "tp")``
DeviceMesh holds global arrays laid out on that mesh (a column-parallel kernel
``P(None, "tp")``, a row-parallel one ``P("tp", None)``, the rest replicated).
``FullyShardedDataParallel(model, opt, group=mesh.get_group("dp"))`` then

* runs its step over the *whole* mesh, as DDP does for such a model
  (:mod:`jaxpg.ddp.step_mesh`): the batch is split over ``dp`` and is the same on every
  ``tp`` rank of a replica, and ``loss_fn`` runs the tensor-parallel code on each device's
  blocks;
* shards each parameter over ``dp`` on top of its tensor-parallel split
  (:class:`~jaxpg.data_parallel.leaf_split.LeafSplit` with the parameter's
  ``base_spec``): dim 0's spec entry gains ``"dp"`` (``P("dp", "tp")`` for a column-parallel kernel,
  ``P(("tp", "dp"))`` for a row-parallel one, whose ``tp`` blocks are each padded alone);
  gathering over ``dp`` inside the step gives back exactly the block the
  tensor-parallel code expects, and gradients are reduce-scattered over ``dp`` only.

HSDP (a 2-D ``group``) of a tensor-parallel model is refused: pass the data-parallel
dimension's process group.

Expert parallelism (``expert_axes=("ep",)``, a ``jaxpg.expert_parallel.MoELayer`` on a
``("dp", "ep")`` mesh, ``group`` the whole mesh's data-parallel ranks): the batch is split
over ``dp`` and ``ep``; each parameter is sharded over ``dp`` only, the experts on top of
their ``ep`` split; an expert's gradient is reduce-scattered over ``dp`` only (the
``all_to_all`` already brought it every token of its ep group), every other gradient also
summed over ``ep``; all are divided by ``dp · ep``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.sharding import NamedSharding

from jaxpg.data_parallel.leaf_split import LeafSplit
from jaxpg.ddp.step_mesh import StepMesh, cp_group_fix, step_mesh
from jaxpg.fsdp.shard_group import ShardGroup

__all__ = ["compose_with_model_mesh", "local_block_shape", "has_block_padding"]


def _elsewhere(group: ShardGroup, tree: Any) -> bool:
    """Whether a leaf is split over, or lives on a larger mesh than, the group's."""
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            continue
        split = any(e is not None for e in sharding.spec)
        if split or (sharding.mesh != group.mesh and sharding.mesh.devices.size > group.size):
            return True
    return False


def compose_with_model_mesh(group: ShardGroup, given: Any, params: Any, rest: Any,
                            api: str, sequence: Any = None,
                            expert_axes: tuple[str, ...] = ()
                            ) -> tuple[ShardGroup, StepMesh | None]:
    """``group`` extended to the mesh a tensor-parallel model lives on (or the
    ``context_parallel`` group's), and that mesh's layout of ``params`` and ``rest`` (None
    for a plain model: ``group`` unchanged).

    Args:
        group: the resolved FSDP group.
        given: the ``group`` argument as the user passed it (for the error).
        params: the model's parameters.
        rest: the rest of its state.
        api: the caller's name, for errors.
        sequence: the batch's sequence split (``context_parallel=``), or None.
        expert_axes: the expert-parallel axes of the group (``expert_axes=``).

    Raises:
        ValueError: for an HSDP group with a tensor-parallel model or context
            parallelism, or a model laid out
            on a mesh the group is not a dimension of (named by
            :func:`jaxpg.ddp.step_mesh.step_mesh`).
    """
    if sequence is None and not _elsewhere(group, (params, rest)):
        if expert_axes:
            raise ValueError(
                f"{api}: expert_axes={tuple(expert_axes)} with a model that no mesh splits: "
                "the experts must be laid out on the mesh whose axes they name (a MoELayer "
                "built with group=mesh['ep'] on a ('dp', 'ep') mesh); drop expert_axes for "
                "a dense model.")
        return group, None
    if expert_axes and sequence is not None:
        raise ValueError(f"{api}: expert_axes with context_parallel= is not supported; use "
                         "one of them.")
    if group.replicate_axes:  # HSDP: a 2-D DeviceMesh, a HybridCommunicateGroup
        if sequence is not None:
            raise ValueError(
                f"{api}: group={given!r} with context_parallel=: HSDP and hybrid groups do "
                "not compose with context parallelism here; pass the shard and cp "
                "dimensions flattened, e.g. "
                f"{cp_group_fix('dp_shard_cp', tuple(getattr(given, 'mesh_dim_names', ())))}."
            )
        raise ValueError(
            f"{api}: group={given!r} with a tensor-parallel model (its arrays are laid out "
            "on a larger mesh): HSDP and hybrid groups do not compose with tensor "
            "parallelism here; pass the data-parallel dimension's process group, e.g. "
            "group=mesh.get_group('dp'), to shard over dp on top of the tp split."
        )
    layout = step_mesh(group.process_group, params, rest, api=api, sequence=sequence,
                         cp_flat="dp_shard_cp",
                         expert_axes=tuple(expert_axes))
    model_axes = tuple(a for a in layout.mesh.axis_names if a not in layout.dp_axes)
    shard_axes = tuple(a for a in layout.dp_axes if a not in expert_axes)
    composed = dataclasses.replace(group, mesh=layout.mesh, shard_axes=shard_axes,
                                   replicate_axes=(), model_axes=model_axes, sequence=sequence,
                                   expert_axes=tuple(expert_axes))
    return composed, layout


def local_block_shape(lay: LeafSplit, mesh_shape: dict[Any, int]) -> tuple[int, ...]:
    """One device's unsharded block of a parameter (its tensor-parallel block): the true
    shape with every dimension but the sharded one divided by its ``base_spec`` axes."""
    if not lay.sharded:
        return lay.shape
    entries = list(lay.base_spec) + [None] * (len(lay.shape) - len(lay.base_spec))
    shape = []
    for d, (size, entry) in enumerate(zip(lay.shape, entries, strict=True)):
        if d == lay.dim:
            shape.append(lay.block_dim0)
            continue
        names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        shape.append(size // math.prod(mesh_shape[a] for a in names))
    return tuple(shape)


def has_block_padding(layouts: Any) -> bool:
    """Whether a leaf is split into tensor-parallel blocks on its sharded dimension and
    padded (zero rows inside the array, not only at its end)."""
    return any(lay.dim0_blocks > 1 and lay.padding
               for lay in jax.tree.leaves(layouts, is_leaf=lambda x: isinstance(x, LeafSplit)))
