"""Fully sharded pipeline stages: FSDP (ZeRO stage 3) over the stage's ``dp_shard`` group.

As torchtitan applies FSDP2's ``fully_shard`` to each stage module on its sub-mesh (FSDP x
PP, with TP: FSDP x TP x PP), a ``("pp", "dp_shard")`` mesh puts model stage ``s`` on the
dp_shard processes of pp coordinate ``s``. Each of them passes
``PipelineStage(module, s, n, group=mesh["pp"], fsdp_group=mesh["dp_shard"])`` with the same
module (built from the same seed, as each torch rank builds its model before ``fully_shard``);
:func:`stage_fully_shard` splits every parameter along its leading dimension over the group
(``NamedSharding(stage mesh, P("dp_shard"))``, each device keeping its shard) and replicates
the module's other state.

The stage's programs (``jaxpg.pipeline.stage.submesh_programs``) are SPMD programs over the
stage's mesh, written with explicit collectives rather than left to XLA's partitioner, so
that the schedule is FSDP's and not whatever the partitioner infers for a program that keeps
its residuals: each microbatch's forward all-gathers the parameters, its backward gathers
them again (the gathered copy is never a residual: torch's ``reshard_after_forward=True``)
and reduce-scatters the weight gradient (the all-gather's transpose), so each rank
accumulates only its shard, and an optax update over ``stage.grads`` updates shards.
With ``reshard_after_forward=False`` the parameters are gathered once a step instead and
kept for its microbatches; each rank sums its own whole gradient, and one program
reduce-scatters that sum after the step's last backward.

Data parallelism inside the stage: each process of the group passes its own part of the
batch to ``step`` (as each torch FSDP rank feeds its own data), and the reduce-scatter sums
the ranks' gradients of their rows (``jaxpg.pipeline.stage.data_split``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.groups.process_group import ProcessGroup
from jaxpg.groups.resolve import resolve_group
from jaxpg.pipeline.stage.data_split import DataSplit, summed_gradient
from jaxpg.pipeline.stage.programs import GATHERED, plain_programs

__all__ = ["StageFSDP", "stage_fully_shard"]


def _state_paths(state: Any) -> list[str]:
    """Each leaf's path in ``state``, dotted."""
    return [".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                     for k in path if getattr(k, "name", None) != "value")
            for path, _ in jax.tree_util.tree_leaves_with_path(state)]  # fmt: skip


@functools.lru_cache(maxsize=16)
def _gather_all(layout: StageFSDP):
    """One program: the shards -> the whole parameters, replicated over the group."""
    pspecs = layout.shard_specs()[0]

    def body(params):
        return jax.tree.map(lambda x, spec: x if spec == P() else lax.all_gather(
            x, layout.axis, axis=0, tiled=True), params, pspecs)

    return jax.jit(jax.shard_map(body, mesh=layout.mesh, in_specs=(pspecs,),
                                 out_specs=jax.tree.map(lambda _: P(), pspecs),
                                 check_vma=False))


@functools.lru_cache(maxsize=16)
def _reduce_scatter(layout: StageFSDP):
    """One program: each rank's whole gradient (a leading axis over the group) -> the
    sum's shards (a 0-d parameter's sum, replicated)."""
    pspecs = layout.shard_specs()[0]

    def body(grads):
        return jax.tree.map(lambda g, spec: lax.psum(g[0], layout.axis) if spec == P() else
                            lax.psum_scatter(g[0], layout.axis, scatter_dimension=0,
                                             tiled=True), grads, pspecs)

    return jax.jit(jax.shard_map(body, mesh=layout.mesh,
                                 in_specs=(jax.tree.map(lambda _: P(layout.axis), pspecs),),
                                 out_specs=pspecs, check_vma=False), donate_argnums=0)


@dataclasses.dataclass(frozen=True, repr=False)
class StageFSDP(DataSplit):
    """A stage's full sharding: its dp_shard group as the 1-D mesh ``mesh`` (axis ``axis``),
    this process's device, and which parameters are split (the rest are replicated).

    Attributes:
        mesh: the stage's 1-D mesh over its dp_shard group's devices.
        axis: the mesh's axis name (the group's dimension name, e.g. ``"dp_shard"``).
        group: the dp_shard ``ProcessGroup``.
        device: this process's device on ``mesh``.
        param_specs: ``(treedef, specs)`` of the ``nnx.Param`` state: ``P(axis)`` for a
            split leaf, ``P()`` for a 0-d one.
        rest_specs: the same for the module's other state (all ``P()``).
        reshard_after_forward: torch's: True gathers the parameters in every microbatch's
            forward and backward; False once per step (:meth:`step_params`), each rank
            then summing its own whole gradient until :meth:`finish_grads` reduce-scatters
            it after the step's last backward.
    """

    mesh: Mesh
    axis: str
    group: ProcessGroup
    device: Any
    param_specs: tuple[Any, tuple] = dataclasses.field(default=(), repr=False)
    rest_specs: tuple[Any, tuple] = dataclasses.field(default=(), repr=False)
    reshard_after_forward: bool = True
    arg_name = "fsdp_group"

    def __repr__(self) -> str:
        return f"StageFSDP(axis={self.axis!r}, devices={[d.id for d in self.mesh.devices.flat]})"

    def shard_specs(self) -> tuple[Any, Any]:
        """``(param specs, rest specs)`` of the placed state, as trees of its structure."""
        return tuple(jax.tree.unflatten(*s) for s in (self.param_specs, self.rest_specs))

    def specs(self) -> tuple[Any, Any]:
        """``(param specs, rest specs)`` of what the programs take: the shards, or with
        ``reshard_after_forward=False`` the whole parameters (replicated)."""
        params, rest = self.shard_specs()
        if not self.reshard_after_forward:
            params = jax.tree.map(lambda _: P(), params)
        return params, rest

    def grad_specs(self) -> Any:
        """The specs of the weight gradients a program gives: the shards', or each rank's
        whole gradient (a leading axis over the group)."""
        if self.reshard_after_forward:
            return self.shard_specs()[0]
        return jax.tree.map(lambda _: P(self.axis), self.shard_specs()[0])

    def weight_grads(self, grads: Any) -> Any:
        """A rank's weight gradients as the programs give them (inside an SPMD program)."""
        if self.reshard_after_forward:
            return grads
        return jax.tree.map(lambda g: g[None], grads)

    def step_params(self, params: Any) -> Any:
        """The parameters a step's programs take: the shards, or with
        ``reshard_after_forward=False`` the whole parameters, gathered once (one program)."""
        return params if self.reshard_after_forward else _gather_all(self)(params)

    def finish_grads(self, grads: Any) -> Any:
        """A step's gradients as ``stage.grads`` holds them, split over the group: with
        ``reshard_after_forward=False`` each rank's whole sum reduce-scattered (one
        program)."""
        if self.reshard_after_forward or grads is None:
            return grads
        return _reduce_scatter(self)(grads)

    def base_programs(self, graphdef: Any, loss_fn: Any, first: bool) -> Any:
        """The per-rank programs: a plain stage's on the gathered parameters, each rank's
        loss divided by the group's size."""
        gather = self.gather if self.reshard_after_forward else None  # whole already
        return plain_programs(graphdef, loss_fn, first, gather, self.size)

    def gather(self, params: Any) -> Any:
        """Parameter shards -> the whole parameters (inside an SPMD program): split leaves
        all-gathered (their gradient reduce-scattered), replicated ones kept (their gradient
        summed); with ``reshard_after_forward=False`` the parameters come whole and each
        rank's gradient is its own."""
        if not self.reshard_after_forward:
            return params
        same = summed_gradient(self.axis)

        def one(x, spec):
            if spec == P():
                return same(x)
            return checkpoint_name(lax.all_gather(x, self.axis, axis=0, tiled=True), GATHERED)

        return jax.tree.map(one, params, self.shard_specs()[0])

    # placement
    def _shard(self, a: Any, spec: P) -> jax.Array:
        sharding = NamedSharding(self.mesh, spec)
        if isinstance(a, jax.Array) and a.sharding == sharding:
            return a
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            raise ValueError(f"PipelineStage fsdp_group={self.group!r}: an array laid out as "
                             f"{a.sharding} cannot be placed on the stage's mesh; pass the "
                             "module with its arrays on this process.")
        host = np.asarray(a)
        return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])

    def place(self, tree: Any) -> Any:
        """``tree`` (the module's ``nnx.Param`` state, or its other state) on the stage's
        mesh with the layout's specs."""
        params = jax.tree.structure(tree) == self.param_specs[0]
        return jax.tree.map(self._shard, tree, self.shard_specs()[0 if params else 1])


def stage_fully_shard(module: nnx.Module, given: Any, *, device: Any, me: int,
                      pipeline: ProcessGroup, data_parallel: ProcessGroup | None,
                      tensor_parallel: Any, reshard_after_forward: bool = True,
                      ) -> tuple[ProcessGroup, StageFSDP] | None:
    """The stage's dp_shard group and layout (sharding the module's arrays over it), or None.

    Args:
        module: the stage's module, the same (whole) values on every process of the group.
        given: ``fsdp_group=`` (None: no full sharding).
        device: this process's device; ``me``: its global rank.
        pipeline, data_parallel: the stage's other groups (the dp_shard group meets the
            pipeline group only at this process).
        tensor_parallel: the stage's tp layout (not offered together with FSDP).
        reshard_after_forward: torch's ``fully_shard`` argument (see :class:`StageFSDP`).

    Raises:
        ValueError: a group without this process, sharing ranks with the pipeline group,
            combined with data_parallel_group= or tensor_parallel_group=, a process holding
            only some of the group's devices, or a parameter whose leading dimension the
            group's size does not divide.
    """
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"PipelineStage reshard_after_forward={reshard_after_forward!r} must "
                        "be True or False.")
    if given is None:
        if not reshard_after_forward:
            raise ValueError("PipelineStage reshard_after_forward=False needs fsdp_group= "
                             "(the dp_shard group the stage is fully sharded over).")
        return None
    group = resolve_group(given, api="PipelineStage", arg="fsdp_group")
    arg = f"fsdp_group={given!r}"
    for name, other in (("data_parallel_group", data_parallel),
                        ("tensor_parallel_group", tensor_parallel)):
        if other is not None:
            raise ValueError(f"PipelineStage {arg} with {name}= is not offered: a fully "
                             "sharded stage runs over one dp_shard group; pass one of the two.")
    if me not in group.ranks:
        raise ValueError(f"PipelineStage {arg} (ranks {list(group.ranks)}) does not hold this "
                         f"process's rank {me}; pass this process's dp_shard group (e.g. "
                         "mesh['dp_shard'] of the ('pp', 'dp_shard') mesh).")
    shared = sorted(set(group.ranks) & set(pipeline.ranks))
    if shared != [me]:
        raise ValueError(f"PipelineStage {arg} shares ranks {shared} with the pipeline group "
                         f"{pipeline!r}; the two must be different dimensions of one mesh, "
                         "meeting only at this process (e.g. mesh['dp_shard'] and mesh['pp']).")
    axis = group.mesh_dim[1] if group.mesh_dim is not None else "dp_shard"
    mesh = Mesh(np.asarray(group.devices), (axis,))
    local = sum(d.process_index == jax.process_index() for d in group.devices)
    if local not in (1, mesh.size):
        raise ValueError(f"PipelineStage {arg}: this process holds {local} of the group's "
                         f"{mesh.size} devices; a fully sharded stage runs with one device "
                         "per process (jaxpg-run --nproc-per-node, as torchrun) or the whole "
                         "group in one process.")
    n = mesh.size
    params = nnx.state(module, nnx.Param)
    leaves, treedef = jax.tree.flatten(params)
    for path, a in zip(_state_paths(params), leaves, strict=True):
        shape = tuple(np.shape(a))
        if shape and shape[0] % n:
            raise ValueError(
                f"PipelineStage {arg}: the parameter {path!r} of shape {shape} has a leading "
                f"dimension {shape[0]} that the dp_shard group's size {n} does not divide; "
                f"use a dp_shard degree that divides every parameter's leading dimension, or "
                f"give {path!r} a leading dimension that is a multiple of {n}.")
    rest = nnx.state(module, nnx.Not(nnx.Param))
    rest_leaves, rest_tree = jax.tree.flatten(rest)
    layout = StageFSDP(mesh, axis, group, device,
                       param_specs=(treedef, tuple(P(axis) if np.ndim(a) else P()
                                                   for a in leaves)),
                       rest_specs=(rest_tree, tuple(P() for _ in rest_leaves)),
                       reshard_after_forward=reshard_after_forward)
    nnx.update(module, layout.place(params), layout.place(rest))
    return group, layout
