"""Stages whose group splits each microbatch: by rows (a fully sharded stage, an
expert-parallel one) or along the sequence (a context-parallel one).

Each process of the stage's group feeds its own part of the batch (as each torch FSDP, EP or
CP rank feeds its own data): microbatch ``i`` of the stage is the processes' ``i``-th
microbatches together, activations travel as each process's part to the same rank of the
next stage, and every rank's loss is divided by the group's size inside the differentiated
function, so the gradients summed over the group are those of the mean over the whole
microbatch, and the loss each process reports is that mean (a ``psum``).

:class:`DataSplit` is the part of the sub-mesh layout protocol
(``jaxpg.pipeline.stage.submesh_programs``) that moves those parts; a layout using it has
``mesh`` (the stage's 1-D mesh), ``axis``, ``group``, ``device``, ``arg_name`` (its
``PipelineStage`` argument, for errors) and ``split_dim`` (0: rows, 1: the sequence).
:class:`StageDataParallel` is the layout of an expert- or context-parallel stage: the
arrays laid out over the group's axis (experts) keep their shards, the others are
replicated, their gradients summed over the group.

**Expert-parallel stages** (DeepSeek-V3's PP x EP): a ``("pp", "ep")`` mesh puts model stage
``s`` on the ep processes of pp coordinate ``s``. Each of them builds the same module (the
same seed), its ``MoELayer`` layers over ``mesh["ep"]`` (which hold the experts split over
ep), and passes ``PipelineStage(module, s, n, group=mesh["pp"],
expert_parallel_group=mesh["ep"])``. Each rank routes its own rows, the MoE layers exchange
them with ``all_to_all`` as they do outside a pipeline, and each rank's experts get the
gradient of every rank's rows routed to them.

**Context-parallel stages** (torchtitan's CP x PP): on a ``("pp", "cp")`` mesh each process
of a stage's cp group feeds its part of every sequence (``shard_sequence``'s layout) and its
position ids beside it, the attention runs through ``ContextParallelAttention`` over
``mesh["cp"]``, and every parameter is replicated.

Every stage of such a pipeline passes the group, a stage without experts or attention too:
its parameters are then all replicated, and its data and loss follow the same rule, so that
the cotangents the stages exchange are those of one loss. (A stage passed
``data_parallel_group=`` instead runs as a replica with its own loss, which differs by the
group's size.)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.data_parallel.leaf_split import spec_axes
from jaxpg.groups.mesh_axis import resolve_mesh_axis
from jaxpg.groups.process_group import ProcessGroup
from jaxpg.groups.resolve import resolve_group
from jaxpg.pipeline.stage.programs import plain_programs
from jaxpg.pipeline.stage.tp import (
    PlacedParams,
    check_stage_group,
    mesh_row,
    on_row,
    state_arrays,
    state_specs,
)

__all__ = ["DataSplit", "StageDataParallel", "stage_context_parallel", "stage_expert_parallel",
           "summed_gradient"]


@functools.lru_cache(maxsize=16)
def summed_gradient(axis: str):
    """The identity whose transpose sums over ``axis``: a replicated parameter's use by ranks
    that each see their own rows."""
    @jax.custom_vjp
    def same(x):
        return x

    def fwd(x):
        return x, None

    def bwd(_, g):
        return (lax.psum(g, axis),)

    same.defvjp(fwd, bwd)
    return same


class DataSplit:
    """Activations, targets and losses of a stage whose group splits each microbatch along
    dimension ``split_dim``."""

    arg_name = "group"
    split_dim = 0

    @property
    def size(self) -> int:
        """The group's size."""
        return self.mesh.size

    @property
    def local_count(self) -> int:
        """How many of the stage mesh's devices this process holds."""
        return sum(d.process_index == jax.process_index() for d in self.mesh.devices.flat)

    @property
    def out_spec(self) -> P:
        """Activations are split along ``split_dim``."""
        return P(*(None,) * self.split_dim, self.axis)

    def data_spec(self, x: Any) -> P:
        """The spec of an activation, target or cotangent: split along ``split_dim`` over
        the group (a 0-d value, the loss's cotangent, replicated)."""
        if np.ndim(x) == 0:
            return P()
        if np.ndim(x) <= self.split_dim:
            raise ValueError(f"PipelineStage {self.arg_name}={self.group!r}: an activation of "
                             f"shape {tuple(np.shape(x))} has no dimension {self.split_dim} "
                             f"to split over the stage's {self.axis} group; pass arrays "
                             "(batch, sequence, ...) between context-parallel stages.")
        return P(*(None,) * self.split_dim, self.axis)

    def reduce_loss(self, loss: Any) -> Any:
        """The whole microbatch's mean loss from the ranks' divided ones."""
        return lax.psum(loss, self.axis)

    def _factor(self) -> int:
        return self.size // self.local_count

    def _resized(self, struct: Any, times: int, over: int = 1) -> jax.ShapeDtypeStruct:
        shape = list(struct.shape)
        if len(shape) > self.split_dim:
            shape[self.split_dim] = shape[self.split_dim] * times // over
        return jax.ShapeDtypeStruct(tuple(shape), struct.dtype)

    def global_struct(self, struct: Any) -> jax.ShapeDtypeStruct:
        """The global shape of an activation of this process's shape ``struct``."""
        return self._resized(struct, self._factor())

    def local_struct(self, struct: Any) -> jax.ShapeDtypeStruct:
        """The shape this process holds of a global activation ``struct``."""
        return self._resized(struct, 1, self._factor())

    def check_outputs(self, tree: Any, what: str) -> None:
        """Nothing to check: each rank's outputs are its own rows."""

    def to_global(self, tree: Any) -> Any:
        """This process's parts (activations, targets, cotangents) as arrays on the mesh."""
        here = jax.process_index()
        local = [d for d in self.mesh.devices.flat if d.process_index == here]

        def one(x):
            spec = self.data_spec(x)
            sharding = NamedSharding(self.mesh, spec)
            if isinstance(x, jax.Array) and x.sharding == sharding:
                return x
            if spec == P():
                return jax.make_array_from_single_device_arrays(
                    np.shape(x), sharding, [jax.device_put(x, d) for d in local])
            shape, d = list(np.shape(x)), self.split_dim
            what = "rows" if d == 0 else f"positions along dimension {d}"
            if shape[d] % len(local):
                raise ValueError(
                    f"PipelineStage {self.arg_name}={self.group!r}: a microbatch of "
                    f"{shape[d]} {what} (shape {tuple(shape)}) does not split over this "
                    f"process's {len(local)} devices of the stage's {self.axis} group; use "
                    f"a multiple of {len(local)} {what} in each microbatch.")
            shape[d] *= self._factor()
            return jax.make_array_from_process_local_data(sharding, x, tuple(shape))

        return jax.tree.map(one, tree)

    def to_local(self, tree: Any) -> Any:
        """This process's part of each array: the shard on its device (the whole array when
        the process holds the whole stage mesh)."""
        if self.local_count == self.size:
            return tree
        return jax.tree.map(lambda x: next(s.data for s in x.addressable_shards
                                           if s.device == self.device), tree)


@dataclasses.dataclass(frozen=True, repr=False)
class StageDataParallel(PlacedParams, DataSplit):
    """An expert- or context-parallel stage: its group as the 1-D mesh ``mesh`` (axis
    ``axis``), this process's device, and the specs of the module's state (the experts
    ``P(axis)``, the rest ``P()``).

    Attributes:
        mesh: the stage's 1-D mesh over its group's devices.
        axis: the group's axis name (the one the module's layers use).
        group: the ep or cp ``ProcessGroup``.
        device: this process's device on ``mesh``.
        param_specs: ``(treedef, specs)`` of the ``nnx.Param`` state.
        rest_specs: the same for the module's other state.
        split_dim: the dimension the group splits: 0 (EP: rows), 1 (CP: the sequence).
        arg_name: the ``PipelineStage`` argument that made it, for errors.
    """

    mesh: Mesh
    axis: str
    group: ProcessGroup
    device: Any
    param_specs: tuple[Any, tuple] = dataclasses.field(default=(), repr=False)
    rest_specs: tuple[Any, tuple] = dataclasses.field(default=(), repr=False)
    split_dim: int = 0
    arg_name: str = "expert_parallel_group"

    def __repr__(self) -> str:
        return (f"StageDataParallel(axis={self.axis!r}, split_dim={self.split_dim}, "
                f"devices={[d.id for d in self.mesh.devices.flat]})")

    def base_programs(self, graphdef: Any, loss_fn: Any, first: bool) -> Any:
        """The per-rank programs: a plain stage's on the rank's experts, the replicated
        parameters' gradients summed over the group, each rank's loss divided by its size."""
        return plain_programs(graphdef, loss_fn, first, self.gather, self.size)

    def gather(self, params: Any) -> Any:
        """The parameters a rank's module takes (inside an SPMD program): its experts as they
        are, the replicated parameters through :func:`summed_gradient`."""
        same = summed_gradient(self.axis)
        return jax.tree.map(lambda x, spec: same(x) if spec == P() else x, params,
                            self.specs()[0])

    def place(self, tree: Any) -> Any:
        """``tree``'s arrays on the stage's mesh: those laid out over the group keep their
        shards, the others (one process's copy) are replicated."""
        here = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
        replicated = NamedSharding(self.mesh, P())

        def one(a):
            if isinstance(a, jax.Array) and isinstance(a.sharding, NamedSharding) and \
                    a.sharding.mesh.size > 1:
                return on_row(self.mesh, a)
            return jax.make_array_from_single_device_arrays(
                np.shape(a), replicated, [jax.device_put(a, d) for d in here])

        return jax.tree.map(one, tree)


#: Per parallelism: (PipelineStage argument, degree, split dimension, its layers' fix).
_KINDS = {
    "ep": ("expert_parallel_group", "expert-parallel", 0,
           "build the stage's MoELayers with group=mesh['ep'], the group passed here"),
    "cp": ("context_parallel_group", "context-parallel", 1,
           "build the stage's ContextParallelAttention layers with group=mesh['cp'], the "
           "group passed here; a context-parallel stage's parameters are replicated"),
}


def _stage_data_parallel(kind: str, module: nnx.Module, given: Any, *, device: Any, me: int,
                         pipeline: ProcessGroup, others: dict[str, Any],
                         ) -> tuple[ProcessGroup, StageDataParallel] | None:
    """The stage's ``kind`` group and layout (placing the module's arrays on its mesh)."""
    if given is None:
        return None
    arg_name, degree, split_dim, fix = _KINDS[kind]
    a_degree = f"{'an' if degree[0] in 'aeiou' else 'a'} {degree}"
    group = resolve_group(given, api="PipelineStage", arg=arg_name)
    arg = f"{arg_name}={given!r}"
    for name, other in others.items():
        if other is not None:
            raise ValueError(f"PipelineStage {arg} with {name}= is not offered: {a_degree} "
                             f"stage runs over one {kind} group, which is also its "
                             "data-parallel group; pass one of the two.")
    check_stage_group(group, arg, me, {"pipeline": pipeline}, degree, kind)
    axis = resolve_mesh_axis(group, kind, api="PipelineStage", arg=arg_name)
    row = mesh_row(axis.mesh, axis.axis, device)
    if list(row.devices.flat) != list(group.devices):
        raise ValueError(f"PipelineStage {arg} is not one dimension of a mesh; pass "
                         f"mesh['{kind}'] of the ('pp', '{kind}') mesh.")
    local = sum(d.process_index == jax.process_index() for d in group.devices)
    if local not in (1, row.size):
        raise ValueError(f"PipelineStage {arg}: this process holds {local} of the group's "
                         f"{row.size} devices; {a_degree} stage runs with one device per "
                         "process (jaxpg-run --nproc-per-node, as torchrun) or the whole "
                         "group in one process.")
    for path, a in state_arrays(module):
        sharding = a.sharding
        if not isinstance(sharding, NamedSharding) or sharding.mesh.size == 1:
            continue  # one process's copy: replicated on the stage's mesh
        over = spec_axes(sharding.spec)
        if sharding.mesh not in (axis.mesh, row) or not over <= {axis.axis} or (
                kind == "cp" and over):
            raise ValueError(f"PipelineStage {arg}: the module's array {path!r} is laid out "
                             f"as {sharding}, not on the group's mesh {dict(axis.mesh.shape)}"
                             f"{f' split over {axis.axis!r} only' if kind == 'ep' else ''}; "
                             f"{fix}.")
    layout = StageDataParallel(row, axis.axis, group, device, split_dim=split_dim,
                               arg_name=arg_name)
    params, rest = nnx.state(module, nnx.Param), nnx.state(module, nnx.Not(nnx.Param))
    params, rest = layout.place(params), layout.place(rest)
    nnx.update(module, params, rest)
    return group, dataclasses.replace(layout, param_specs=state_specs(params),
                                      rest_specs=state_specs(rest))


def stage_expert_parallel(module: nnx.Module, given: Any, *, device: Any, me: int,
                          pipeline: ProcessGroup, others: dict[str, Any],
                          ) -> tuple[ProcessGroup, StageDataParallel] | None:
    """The stage's ep group and layout (placing the module's arrays on its mesh), or None.

    Args:
        module: the stage's module, the same values on every process of the group, its
            ``MoELayer`` layers built over this group (a stage without any: every parameter
            replicated, its gradient summed over the group).
        given: ``expert_parallel_group=`` (None: no expert parallelism).
        device: this process's device; ``me``: its global rank.
        pipeline: the pipeline group (the ep group meets it only at this process).
        others: the stage's other layouts' arguments (name: value); none may be set.

    Raises:
        ValueError: a group without this process or sharing ranks with the pipeline group,
            another layout argument set, a process holding several of the group's devices,
            or an array laid out on another mesh or axis.
    """
    return _stage_data_parallel("ep", module, given, device=device, me=me, pipeline=pipeline,
                                others=others)


def stage_context_parallel(module: nnx.Module, given: Any, *, device: Any, me: int,
                           pipeline: ProcessGroup, others: dict[str, Any],
                           ) -> tuple[ProcessGroup, StageDataParallel] | None:
    """The stage's cp group and layout (its parameters replicated on its mesh), or None.

    Args:
        module: the stage's module, the same values on every process of the group, its
            attention through ``ContextParallelAttention(group=<this group>)``.
        given: ``context_parallel_group=`` (None: no context parallelism).
        device, me, pipeline, others: as :func:`stage_expert_parallel`'s.

    Raises:
        ValueError: as :func:`stage_expert_parallel`, and for an array split over an axis.
    """
    return _stage_data_parallel("cp", module, given, device=device, me=me, pipeline=pipeline,
                                others=others)
