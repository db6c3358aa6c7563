"""The ranks FSDP shards over (and, for HSDP, replicates over), and placing data on them.

``group`` may be:

* ``None`` (the world) or a ``ProcessGroup``: every rank holds a shard (FSDP);
* a 1-D ``DeviceMesh`` (``mesh["dp"]``): the same, over its dimension's group;
* a ``ParallelDims``: replicated over ``dp_replicate`` and sharded over ``dp_shard``; with
  ``tp > 1`` (and ``dp_replicate == 1``) sharded over ``dp_shard`` on top of the
  tensor-parallel split;
* a 2-D ``DeviceMesh``: HSDP, as torch's ``fully_shard(mesh=...)`` with a 2-D mesh: the
  first dimension replicates, the second shards (torch's ``("replicate", "shard")``);
* a ``HybridCommunicateGroup``: Paddle's hybrid group, replicated over ``dp`` and sharded
  over ``sharding`` (``sharding_degree``); its ``pp`` and ``mp`` degrees must be 1 here
  (for a pipeline use :mod:`jaxpg.pipeline.zero`).

The batch is split over all ranks, replicas first (row-major over the mesh, which is
global-rank order for meshes made by ``init_device_mesh`` and the hybrid group).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.data_parallel.batch_placement import place_batch
from jaxpg.data_parallel.sequence_batch import (
    place_sequence_batch,
    sample_axes,
    sequence_batch_specs,
)

__all__ = ["ShardGroup", "resolve_shard_group"]


@dataclasses.dataclass(frozen=True, eq=False)
class ShardGroup:
    """The mesh and axes of one FSDP wrapper.

    Attributes:
        mesh: the ``jax.sharding.Mesh`` the step runs on.
        shard_axes: the axes parameters, gradients and optimizer state are split over.
        replicate_axes: the HSDP replica axes (empty for plain FSDP).
        world: the jaxpg world the mesh's devices belong to.
        process_group: a group holding every rank of the mesh (to compare the ranks'
            models at construction).
        model_axes: the mesh axes the model itself is split over (tensor parallelism on
            a ``("dp", "tp")`` mesh; empty otherwise). Every rank of one data-parallel
            position along them trains on the same samples.
        sequence: the batch's sequence split over a cp axis (one of ``shard_axes``:
            torchtitan's ``dp_shard_cp``), or None.
        expert_axes: expert-parallel axes (``("ep",)``): the batch is split over them as
            over the shard axes, the experts are split over them by the model, and every
            other parameter is replicated over them (sharded over ``shard_axes`` only).
    """

    mesh: Mesh
    shard_axes: tuple[Hashable, ...]
    replicate_axes: tuple[Hashable, ...]
    world: Any
    process_group: Any
    model_axes: tuple[Hashable, ...] = ()
    sequence: Any = None
    expert_axes: tuple[Hashable, ...] = ()

    @property
    def batch_axes(self) -> tuple[Hashable, ...]:
        """Every axis of the group: the batch is split over all of them (with expert axes,
        in the mesh's order, as DDP splits it)."""
        if self.expert_axes:
            mine = {*self.shard_axes, *self.expert_axes}
            return tuple(a for a in self.mesh.axis_names if a in mine)
        return (*self.replicate_axes, *self.shard_axes)

    @property
    def num_shards(self) -> int:
        """Ranks sharing one copy of the parameters."""
        return math.prod(self.mesh.shape[a] for a in self.shard_axes)

    @property
    def num_replicas(self) -> int:
        """Copies of the sharded parameters (1 without HSDP)."""
        return math.prod(self.mesh.shape[a] for a in self.replicate_axes)

    @property
    def size(self) -> int:
        """All data-parallel ranks of the group (shards x replicas x expert-parallel ranks)."""
        return self.num_shards * self.num_replicas * self.num_expert_ranks

    @property
    def num_expert_ranks(self) -> int:
        """Ranks along the expert axes (1 without them)."""
        return math.prod(self.mesh.shape[a] for a in self.expert_axes)

    def local_count(self) -> int:
        """Devices of the mesh held by this process."""
        pid = jax.process_index()
        return sum(d.process_index == pid for d in self.mesh.devices.flat)

    def local_batch_positions(self) -> int:
        """Data-parallel positions of this process (its share of the batch's splits)."""
        if not self.model_axes:
            return self.local_count()
        index = [self.mesh.axis_names.index(a) for a in self.batch_axes]
        local = np.vectorize(lambda d: d.process_index == jax.process_index())(
            self.mesh.devices)
        return len({tuple(int(c[i]) for i in index) for c in np.argwhere(local)})

    @property
    def all_local(self) -> bool:
        """Whether this process holds every device of the mesh (the one-process case)."""
        return self.local_count() == self.mesh.devices.size

    @property
    def rank_spec(self) -> P:
        """Per-rank state (``no_sync`` accumulators): one row per device of the mesh."""
        if not self.model_axes:
            return self.batch_spec
        return P(tuple(self.mesh.axis_names))

    def sharding(self, spec: P) -> NamedSharding:
        """``NamedSharding(self.mesh, spec)``."""
        return NamedSharding(self.mesh, spec)

    @property
    def batch_spec(self) -> P:
        """Dim 0 split over every axis of the group."""
        axes = self.batch_axes
        return P(axes[0] if len(axes) == 1 else axes)

    @property
    def sample_axes(self) -> tuple[Hashable, ...]:
        """The axes dim 0 of the batch is split over: all but cp."""
        return sample_axes(self.batch_axes, self.sequence)

    def batch_specs(self, batch: Any) -> Any:
        """The batch's ``PartitionSpec`` (a prefix, or one per leaf with ``sequence``)."""
        if self.sequence is None:
            return self.batch_spec
        return sequence_batch_specs(batch, self.sample_axes, self.sequence)

    # ------------------------------------------------------------------ placing data
    def place_batch(self, batch: Any) -> Any:
        """This process's part of the global batch, split over the group on dim 0 (with
        ``sequence``: over the axes but cp, and the sequences over cp).

        Raises:
            ValueError: if a leaf has no leading dimension or it does not divide among
                this process's ranks (or its sequence among the cp ranks).
        """
        if self.sequence is not None:
            return place_sequence_batch(
                batch, self.mesh, self.sample_axes, self.sequence,
                "data-parallel position(s) of the mesh other than cp (the cp ranks of a "
                "replica get the same samples, each its part of their sequences).")
        return place_batch(batch, self.sharding(self.batch_spec), self.local_batch_positions(),
                           self.all_local, "rank(s) of the FSDP group. Drop or pad the last "
                           "batch.")

    def per_rank(self, tree: Any) -> Any:
        """One copy of ``tree`` per rank, stacked on a leading axis split over the group."""
        n_local = self.local_count()
        sharding = self.sharding(self.rank_spec)

        def place(x):
            stacked = jnp.broadcast_to(jnp.asarray(x)[None], (n_local, *np.shape(x)))
            if self.all_local:
                return jax.device_put(jnp.array(stacked, copy=True), sharding)
            return jax.make_array_from_process_local_data(sharding, np.asarray(stacked))

        return jax.tree.map(place, tree)

    def replicate_from_rank0(self, tree: Any) -> Any:
        """``tree`` as fresh arrays replicated over the mesh, with rank 0's values."""
        replicated = self.sharding(P())
        if self.all_local:
            return jax.tree.map(
                lambda x: jax.device_put(jnp.array(x, copy=True), replicated), tree)
        from jaxpg.data_parallel.prng_keys import unkey

        raw, rekey = unkey(tree)
        stacked = self.sharding(self.batch_spec)
        n_local = self.local_batch_positions()  # one row per batch position held here
        local = jax.tree.map(lambda x: jax.make_array_from_process_local_data(
            stacked, np.repeat(np.asarray(x)[None], n_local, axis=0)), raw)
        return rekey(self._rank0_kernel()(local))

    def _rank0_kernel(self) -> Any:
        axes = self.batch_axes

        def body(local):
            return jax.tree.map(lambda x: from_rank0(x[0], axes), local)

        return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=self.batch_spec,
                                     out_specs=P(), check_vma=False))

    def describe(self) -> str:
        """``'shard over dp (4)'`` or ``'replicate over r (2) x shard over s (4)'``, and
        ``', model split over tp (2)'`` for a tensor-parallel model."""
        shard = f"shard over {'x'.join(map(str, self.shard_axes))} ({self.num_shards})"
        if self.replicate_axes:
            rep = "x".join(map(str, self.replicate_axes))
            shard = f"replicate over {rep} ({self.num_replicas}) x {shard}"
        if self.expert_axes:
            shard += (f", experts split over {'x'.join(map(str, self.expert_axes))} "
                      f"({self.num_expert_ranks})")
        if self.model_axes:
            sizes = math.prod(self.mesh.shape[a] for a in self.model_axes)
            shard += f", model split over {'x'.join(map(str, self.model_axes))} ({sizes})"
        return shard


def from_rank0(x: jax.Array, axes: tuple[Hashable, ...]) -> jax.Array:
    """Inside ``shard_map``: the value of the rank at position 0 of every axis."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) or x.dtype == jnp.bool_:
        return x
    first = jnp.bool_(True)
    for a in axes:
        first = first & (jax.lax.axis_index(a) == 0)
    return jax.lax.psum(jnp.where(first, x, jnp.zeros_like(x)), axes)


def _check_members(mesh: Mesh, what: str, api: str) -> None:
    pid = jax.process_index()
    if not any(d.process_index == pid for d in mesh.devices.flat):
        raise ValueError(
            f"{api}: {what} holds no rank of this process (process {pid}); only processes "
            "with ranks in the group may wrap a model for it."
        )


def _parallel_dims_fix(dims: Any) -> str:
    """What to pass instead of a ``ParallelDims`` that FSDP cannot shard over whole."""
    fixes = []
    if dims.cp > 1:
        flat, cp = dims.axis("dp_shard_cp"), dims.axis("cp")
        fixes.append(f"With context parallelism pass the shard and cp dimensions flattened, "
                     f"group=dims[{flat!r}], and context_parallel=dims[{cp!r}]"
                     + (" (HSDP does not compose with it: dp_replicate=1)."
                        if dims.dp_replicate > 1 else "."))
    if dims.pp > 1 or not fixes:
        fixes.append("For a pipeline use jaxpg.pipeline.zero (ZeRO-1/2 inside each stage).")
    return " ".join(fixes)


def resolve_shard_group(group: Any, api: str) -> ShardGroup:
    """The :class:`ShardGroup` for ``group`` (see the module docstring).

    Raises:
        TypeError: for a ``group`` of another kind.
        ValueError: for a mesh of more than two dimensions, a hybrid group with pipeline
            or model parallelism, or a group that holds no rank of this process.
    """
    from jaxpg.groups import world as _world
    from jaxpg.groups.device_mesh import DeviceMesh
    from jaxpg.groups.hybrid import HybridCommunicateGroup
    from jaxpg.groups.parallel_dims import ParallelDims
    from jaxpg.groups.process_group import ProcessGroup
    from jaxpg.groups.resolve import devices_error, resolve_group

    if not _world.is_initialized():
        _world.init_process_group()
    state = _world.current()
    if isinstance(group, ParallelDims):
        bad = {d: getattr(group, d) for d in ("pp", "cp") if getattr(group, d) != 1}
        if bad or (group.tp > 1 and group.dp_replicate > 1):
            bad.update({"tp": group.tp, "dp_replicate": group.dp_replicate} if not bad else {})
            raise ValueError(
                f"{api}: group={group!r} has {bad}; FullyShardedDataParallel shards over "
                "dp_shard and replicates over dp_replicate, or shards over dp_shard on top of "
                "a tp split. " + _parallel_dims_fix(group))
        if group.tp > 1:  # parallelize first, then shard over dp_shard (model_parallel.py)
            group = group.get_group(group.axis("dp_shard"))
        else:
            mesh = group.jax_mesh
            _check_members(mesh, f"group={group!r}", api)
            return ShardGroup(mesh, (group.axis("dp_shard"),), (group.axis("dp_replicate"),),
                              state, state.world_group)
    if isinstance(group, DeviceMesh) and group.ndim == 1:
        group = group.get_group()  # mesh["dp"]: its process group, as every group= takes
    if group is None or isinstance(group, ProcessGroup) \
            or group is _world.GroupMember.NON_GROUP_MEMBER:  # refused, named, by the world
        pg = resolve_group(group, api=api)
        if not pg.local_members():
            raise ValueError(
                f"{api}: this process holds no rank of {pg!r} (group ranks {list(pg.ranks)}); "
                "only members of the group may wrap a model for it."
            )
        return ShardGroup(pg.jax_mesh, (pg.axis_name,), (), state, pg)
    if isinstance(group, HybridCommunicateGroup):
        bad = {d: group._degree(d) for d in ("pp", "sep", "mp") if group._degree(d) != 1}
        if bad:
            raise ValueError(
                f"{api}: group={group!r} has {bad}; FullyShardedDataParallel shards over its "
                "'sharding' dimension and replicates over 'dp' only. "
                + ("With context parallelism (sep) pass the sharding and sep dimensions "
                   "flattened, group=hcg.device_mesh['sharding', 'sep'].flatten("
                   "'sharding_sep'), and context_parallel=hcg.get_sep_parallel_group()."
                   if "sep" in bad and "pp" not in bad else
                   "For a pipeline use jaxpg.pipeline.zero (ZeRO-1/2 over dp inside each "
                   "stage).")
            )
        mesh = group.device_mesh.jax_mesh
        _check_members(mesh, f"group={group!r}", api)
        return ShardGroup(mesh, ("sharding",), ("dp",), state, state.world_group)
    if isinstance(group, DeviceMesh):
        if group.ndim != 2:
            raise ValueError(
                f"{api}: group={group!r} has {group.ndim} dimensions; pass a 1-D mesh (FSDP) "
                "or a 2-D mesh (HSDP: replicate over the first dimension, shard over the "
                "second), e.g. mesh['dp'] or mesh[('replicate', 'shard')]."
            )
        mesh = group.jax_mesh
        _check_members(mesh, f"group={group!r}", api)
        names = group.mesh_dim_names
        if len(set(group.mesh.flat)) != len(state.devices):
            raise ValueError(
                f"{api}: group={group!r} covers {group.mesh.size} of the world's "
                f"{len(state.devices)} ranks; index a world-sized mesh by its dimension "
                "names (mesh[('replicate', 'shard')]) so every rank runs the same step."
            )
        return ShardGroup(mesh, (names[-1],), tuple(names[:-1]), state, state.world_group)
    raise devices_error(api, "group", group, _FSDP_FORMS)


_FSDP_FORMS = ("a ProcessGroup, a 1-D DeviceMesh (FSDP), a 2-D DeviceMesh (HSDP), a "
               "HybridCommunicateGroup, a ParallelDims or None (the world)")
