"""Tensor-parallel pipeline stages: a stage held by the processes of its tp group.

As torchtitan composes PP with TP, a ``("pp", "tp")`` mesh (or ``("dp", "pp", "tp")``) puts
model stage ``s`` on the tp processes of pp coordinate ``s``; the stage's module is
parallelized over ``mesh["tp"]`` (``parallelize_module``) and its forward and backward are
SPMD programs over that group (``jaxpg.pipeline.stage.submesh_programs``). Activations between
stages are replicated over tp, so each process sends to and receives from its peers in the
pipeline group, the same tp rank of the neighbouring stages.

:func:`stage_tensor_parallel` resolves and checks the group, inferring it from a module
already parallelized when none is given; :meth:`StageTP.place` moves the module's arrays
from the mesh of the whole topology, where ``parallelize_module`` puts them, onto the
stage's own mesh (the tp group's devices, one axis): no data moves, each device keeps its
shard. The stage's programs, gradients and optimizer updates then involve only the stage's
own processes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.collectives.reductions import all_reduce
from jaxpg.data_parallel.leaf_split import spec_axes
from jaxpg.groups import world
from jaxpg.groups.mesh_axis import MeshAxis, resolve_mesh_axis
from jaxpg.groups.process_group import ProcessGroup
from jaxpg.groups.resolve import resolve_group
from jaxpg.pipeline.stage.programs import plain_programs
from jaxpg.reduce_op import ReduceOp

__all__ = ["PlacedParams", "StageTP", "check_stage_group", "mesh_row", "on_row",
           "stage_tensor_parallel", "state_arrays", "state_specs"]

_FIX = ("parallelize the stage's module over this process's tp group first "
        "(parallelize_module(module, mesh['tp'], plan)) and pass that group")


def state_arrays(module: nnx.Module) -> list[tuple[str, Any]]:
    """``(path, array)`` for every array of the module's state."""
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(module))
    return [(".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                      for k in path if getattr(k, "name", None) != "value"), v)
            for path, v in leaves if isinstance(v, jax.Array)]  # fmt: skip


def mesh_row(mesh: Mesh, axis: str, device: Any) -> Mesh:
    """The 1-D mesh along ``axis`` of ``mesh`` through ``device``."""
    where = np.argwhere(np.asarray(mesh.devices) == device)
    if where.size == 0:
        raise ValueError(f"device {device} is not on the mesh {dict(mesh.shape)}")
    d = mesh.axis_names.index(axis)
    index = tuple(slice(None) if i == d else int(c) for i, c in enumerate(where[0]))
    return Mesh(np.asarray(mesh.devices)[index], (axis,))


def on_row(row: Mesh, a: Any) -> Any:
    """``a`` (laid out on a mesh through ``row``'s devices) on the 1-D mesh ``row``, each
    device keeping its own shard; other values as they are."""
    if not isinstance(a, jax.Array) or not isinstance(a.sharding, NamedSharding) or \
            a.sharding.mesh == row:
        return a
    devices = set(row.devices.flat)
    shards = [s.data for s in a.addressable_shards if s.device in devices]
    return jax.make_array_from_single_device_arrays(
        a.shape, NamedSharding(row, a.sharding.spec), shards)


def state_specs(state: Any) -> tuple[Any, tuple]:
    """``(treedef, specs)`` of a placed state's arrays."""
    leaves, tree = jax.tree.flatten(state)
    return tree, tuple(a.sharding.spec for a in leaves)


class PlacedParams:
    """The part of the sub-mesh layout protocol of a stage whose programs take the
    parameters as they are placed (``param_specs``, ``rest_specs``) and give their gradients
    in the same layout, nothing gathered or reduce-scattered around a step."""

    def specs(self) -> tuple[Any, Any]:
        """``(param specs, rest specs)`` as trees of the state's structure."""
        return tuple(jax.tree.unflatten(*s) for s in (self.param_specs, self.rest_specs))

    def grad_specs(self) -> Any:
        """The specs of the weight gradients a program gives: the parameters'."""
        return self.specs()[0]

    def weight_grads(self, grads: Any) -> Any:
        """A rank's weight gradients as the programs give them: its shards'."""
        return grads

    def step_params(self, params: Any) -> Any:
        """The parameters a step's programs take: the placed ones."""
        return params

    def finish_grads(self, grads: Any) -> Any:
        """A step's summed gradients, as ``stage.grads`` holds them: as they are."""
        return grads


@dataclasses.dataclass(frozen=True, repr=False)
class StageTP(PlacedParams, MeshAxis):
    """A stage's tensor parallelism: its group as an axis (a :class:`MeshAxis` over the
    stage's own 1-D mesh), this process's device, and the specs of the module's state.

    Attributes:
        mesh: the stage's 1-D mesh over its tp group's devices, axis ``axis``.
        axis: the tensor-parallel axis name (the one the module's styles use).
        group: the tp ``ProcessGroup``.
        device: this process's device on ``mesh``.
        param_specs: the ``PartitionSpec`` of every ``nnx.Param`` (flattened) and its tree.
        rest_specs: the same for the module's other state.
    """

    device: Any = None
    param_specs: tuple[Any, tuple] = dataclasses.field(default=(), repr=False)
    rest_specs: tuple[Any, tuple] = dataclasses.field(default=(), repr=False)

    def with_specs(self, module: nnx.Module) -> StageTP:
        """This layout with the specs of ``module``'s state (placed on ``mesh``)."""
        return dataclasses.replace(self, param_specs=state_specs(nnx.state(module, nnx.Param)),
                                   rest_specs=state_specs(nnx.state(module, nnx.Not(nnx.Param))))

    # what the sub-mesh programs (``jaxpg.pipeline.stage.submesh_programs``) ask of a layout
    out_spec = P()  # activations are replicated over tp

    def base_programs(self, graphdef: Any, loss_fn: Any, first: bool) -> Any:
        """The per-rank programs the SPMD programs run: a plain stage's, on local shards."""
        return plain_programs(graphdef, loss_fn, first)

    def gather(self, params: Any) -> Any:
        """The parameters a tp rank's module takes: its own shards."""
        return params

    def data_spec(self, x: Any) -> P:
        """The spec of an activation, target or cotangent: replicated over tp."""
        return P()

    def reduce_loss(self, loss: Any) -> Any:
        """A rank's microbatch loss is the whole microbatch's already."""
        return loss

    def global_struct(self, struct: Any) -> Any:
        """An activation's global shape struct: this process's copy is the whole."""
        return struct

    local_struct = global_struct

    def check_outputs(self, tree: Any, what: str) -> None:
        """:meth:`check_replicated`."""
        self.check_replicated(tree, what)

    def place(self, tree: Any) -> Any:
        """``tree``'s arrays on the stage's mesh, each device keeping its own shard."""
        return jax.tree.map(lambda a: on_row(self.mesh, a), tree)

    def to_global(self, tree: Any) -> Any:
        """This process's copy of replicated values (activations) as arrays on the mesh."""
        sharding = NamedSharding(self.mesh, P())
        local = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
        return jax.tree.map(lambda x: jax.make_array_from_single_device_arrays(
            np.shape(x), sharding, [jax.device_put(x, d) for d in local]), tree)

    def to_local(self, tree: Any) -> Any:
        """The shard on this process's device of each array of ``tree``."""
        return jax.tree.map(lambda x: next(s.data for s in x.addressable_shards
                                           if s.device == self.device), tree)

    def check_replicated(self, tree: Any, what: str) -> None:
        """Raises unless ``tree``'s arrays (outputs of an SPMD program, spec ``P()``) hold the
        same values on every device of the stage's mesh: activations between stages are
        replicated over tp, and a module whose last layer leaves its output sharded would
        send each peer a different piece. One small program; every tp rank gets the same
        answer, so all of them raise."""
        leaves = [a for a in jax.tree.leaves(tree) if a.size]
        if not leaves:
            return
        row, sharding = set(self.mesh.devices.flat), NamedSharding(self.mesh, P(self.axis))
        stacked = [jax.make_array_from_single_device_arrays(
            (self.mesh.size, *a.shape), sharding,
            [s.data[None] for s in a.addressable_shards if s.device in row]) for a in leaves]
        spread, largest = (float(v) for v in _spread(self.mesh, self.axis)(stacked))
        if spread > 1e-5 * max(1.0, largest):
            ids = [d.id for d in self.mesh.devices.flat]
            raise ValueError(
                f"PipelineStage: the {what} of a tensor-parallel stage differs across its tp "
                f"group (devices {ids}, axis {self.axis!r}) by up to {spread:.3g}: activations "
                "between stages are replicated over tp, but the stage's last "
                "tensor-parallel layer leaves its output sharded. End the stage with a layer "
                "whose output is replicated: RowwiseParallel(), or "
                "ColwiseParallel(output_layouts=Replicate()).")

    def data_parallel_mean(self, grads: Any, group: ProcessGroup) -> Any:
        """``grads`` averaged over ``group``: each process's shards (one device per process),
        in one all_reduce."""
        flat, unravel = ravel_pytree(self.to_local(grads))
        mean = unravel(all_reduce(flat, op=ReduceOp.AVG, group=group))
        return jax.tree.map(lambda g, m: jax.make_array_from_single_device_arrays(
            g.shape, g.sharding, [jax.device_put(m, self.device)]), grads, mean)


@functools.lru_cache(maxsize=16)
def _spread(mesh: Mesh, axis: str):
    """A program: the largest difference of arrays (leading axis over ``axis``) from their
    mean over ``axis``, and their largest magnitude, both replicated."""
    def body(xs):
        xs = [x[0].astype(jnp.float32) for x in xs]
        spread = jnp.max(jnp.stack([jnp.max(jnp.abs(x - jax.lax.pmean(x, axis))) for x in xs]))
        largest = jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in xs]))
        return jax.lax.pmax(spread, axis), jax.lax.pmax(largest, axis)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(),
                                 check_vma=False))


def check_stage_group(tp: ProcessGroup, arg: str, me: int, others: dict[str, Any],
                      kind: str = "tensor-parallel", dim: str = "tp") -> None:
    """Raises unless the stage's ``kind`` group ``tp`` (mesh dimension ``dim``) holds this
    process's rank ``me`` and meets each of ``others`` (name: group or None) only there."""
    if me not in tp.ranks:
        raise ValueError(f"PipelineStage {arg} (ranks {list(tp.ranks)}) does not hold this "
                         f"process's rank {me}; pass this process's {kind} group "
                         f"(e.g. mesh['{dim}'] of the ('pp', '{dim}') mesh).")
    for name, group in others.items():
        if group is None:
            continue
        shared = sorted(set(tp.ranks) & set(group.ranks))
        if shared != [me]:
            raise ValueError(f"PipelineStage {arg} shares ranks {shared} with the {name} group "
                             f"{group!r}; the two must be different dimensions of one mesh, "
                             f"meeting only at this process (e.g. mesh['{dim}'] and "
                             f"mesh['{'pp' if name == 'pipeline' else 'dp'}']).")


def _is_dimension(group: ProcessGroup, mesh: Mesh, axis: str) -> bool:
    """Whether ``group`` is the ``axis`` dimension of ``mesh`` (or ``mesh`` is its own row)."""
    if group.mesh_dim is None:
        return (group.jax_mesh, group.axis_name) == (mesh, axis)
    whole, name = group.mesh_dim
    return name == axis and (whole == mesh or (
        mesh.axis_names == (axis,) and list(group.devices) == list(mesh.devices.flat)))


def _inferred(arrays: list[tuple[str, Any]], state: Any, me: int) -> ProcessGroup | None:
    """The tp group of a module parallelized already (None: a plain module)."""
    meshes = {a.sharding.mesh for _, a in arrays
              if isinstance(a.sharding, NamedSharding) and a.sharding.mesh.size > 1}
    if not meshes:
        return None
    axes = set().union(*(spec_axes(a.sharding.spec) for _, a in arrays
                         if isinstance(a.sharding, NamedSharding)))
    groups = [] if len(meshes) > 1 or len(axes) != 1 else [
        g for g in state.groups.values()
        if me in g.ranks and _is_dimension(g, next(iter(meshes)), next(iter(axes)))]
    if not groups:
        raise ValueError(f"PipelineStage: the module's arrays are laid out on meshes "
                         f"{[dict(m.shape) for m in meshes]} over axes {sorted(axes)}, and no "
                         "group of this process is that mesh's tensor-parallel dimension, so "
                         "it cannot be inferred; pass tensor_parallel_group=mesh['tp'] (the "
                         "group the module was parallelized over).")
    return groups[0]


def stage_tensor_parallel(module: nnx.Module, given: Any, *, device: Any, me: int,
                          pipeline: ProcessGroup, data_parallel: ProcessGroup | None,
                          ) -> tuple[ProcessGroup, StageTP] | None:
    """The stage's tp group and layout (placing the module's arrays on its mesh), or None.

    Args:
        module: the stage's module.
        given: ``tensor_parallel_group=`` (None: inferred from the module's arrays, as torch
            reads a DTensor's mesh; a plain module has none).
        device: this process's device; ``me``: its global rank.
        pipeline, data_parallel: the stage's other groups (the tp group meets each only
            at this process).

    Raises:
        ValueError: a group without this process, sharing ranks with the pipeline or
            data-parallel group, or a module not parallelized over it.
    """
    arrays = state_arrays(module)
    if given is None:
        group = _inferred(arrays, world.current(), me)
        if group is None:
            return None
        arg = f"tensor_parallel_group=None (inferred from the module: {group!r})"
    else:
        group = resolve_group(given, api="PipelineStage", arg="tensor_parallel_group")
        arg = f"tensor_parallel_group={given!r}"
    check_stage_group(group, arg, me, {"pipeline": pipeline, "data-parallel": data_parallel})
    tp = resolve_mesh_axis(group, "tp", api="PipelineStage", arg="tensor_parallel_group")
    mesh, axis = tp.mesh, tp.axis
    row = mesh_row(mesh, axis, device)
    if list(row.devices.flat) != list(group.devices):
        raise ValueError(f"PipelineStage {arg} is not one dimension of a mesh; pass "
                         "mesh['tp'] of the ('pp', 'tp') mesh.")
    for path, a in arrays:
        sharding = a.sharding
        if not (isinstance(sharding, NamedSharding) and sharding.mesh in (mesh, row)
                and spec_axes(sharding.spec) <= {axis}):
            raise ValueError(f"PipelineStage {arg}: the module's array {path!r} is laid out "
                             f"as {sharding}, not on the group's mesh {dict(mesh.shape)} split "
                             f"over {axis!r} only; {_FIX}.")
    layout = StageTP(row, axis, group, device=device)
    nnx.update(module, layout.place(nnx.state(module)))
    return group, layout.with_specs(module)
