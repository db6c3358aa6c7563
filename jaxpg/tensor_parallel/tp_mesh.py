"""The tensor-parallel group as a mesh axis: which ``jax.sharding.Mesh``, which axis name.

Every tensor-parallel parameter is a global ``jax.Array`` laid out by a ``NamedSharding`` on
the mesh of the *whole* topology (a ``("dp", "tp")`` DeviceMesh, a HybridCommunicateGroup's
``("dp", "pp", "mp")`` mesh), split over one axis of it and replicated over the others. So
data parallelism and the pipeline, which run over that same mesh, find the parameters where
they expect them. :func:`resolve_tp_mesh` turns what a user passes (a group, a 1-D
DeviceMesh, a HybridCommunicateGroup, or None for the HCG's model-parallel group) into that
``(mesh, axis)`` pair, the :class:`TPMesh`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh

from jaxpg.groups import world as _world
from jaxpg.groups.device_mesh import DeviceMesh
from jaxpg.groups.hybrid import HybridCommunicateGroup, get_hybrid_communicate_group
from jaxpg.groups.parallel_dims import ParallelDims
from jaxpg.groups.process_group import NON_GROUP_MEMBER, ProcessGroup
from jaxpg.groups.resolve import devices_error, resolve_group

__all__ = ["TPMesh", "resolve_tp_mesh", "in_spmd"]

_TP_FORMS = ("a ProcessGroup, a 1-D DeviceMesh (mesh['tp']), a ParallelDims (its tp axis), a "
             "HybridCommunicateGroup (its mp group) or None (the latest "
             "HybridCommunicateGroup's mp group)")


@dataclasses.dataclass(frozen=True)
class TPMesh:
    """A tensor-parallel group: the mesh its arrays live on and its axis there.

    Attributes:
        mesh: the ``jax.sharding.Mesh`` of the whole topology.
        axis: the name of the tensor-parallel axis of ``mesh``.
    """

    mesh: Mesh
    axis: str

    @property
    def size(self) -> int:
        """The tensor-parallel degree."""
        return int(self.mesh.shape[self.axis])

    def rank(self) -> int:
        """The acting rank's coordinate along the axis (host code; see ``jaxpg.as_rank``)."""
        state = _world.current()
        acting = state.devices[state.acting_rank()]
        where = np.argwhere(np.asarray(self.mesh.devices) == acting)
        if where.size == 0:
            raise ValueError(
                f"the acting rank {state.acting_rank()} is not on the tensor-parallel mesh "
                f"(devices {[d.id for d in self.mesh.devices.flat]}); act as one of its ranks "
                "(jaxpg.as_rank) or use a group that holds it."
            )
        return int(where[0][self.mesh.axis_names.index(self.axis)])

    def __repr__(self) -> str:
        return f"TPMesh(axis={self.axis!r}, size={self.size}, mesh={dict(self.mesh.shape)})"


def _family_mesh(group: ProcessGroup, api: str) -> tuple[Mesh, str]:
    """A group made by ``new_subgroups``: its family's rows become the tensor-parallel axis."""
    sizes = {len(f) for f in group.family}
    if len(sizes) != 1:
        raise ValueError(
            f"{api}: group {group.group_name!r} belongs to a family of uneven subgroups "
            f"{[list(f) for f in group.family]}, which is not one dimension of a mesh; use a "
            "DeviceMesh dimension (init_device_mesh(...)['tp']) or equal-sized subgroups."
        )
    devices = np.array([[group._world.devices[r] for r in row] for row in group.family],
                       dtype=object)
    return Mesh(devices, (f"{group.axis_name}_others", group.axis_name)), group.axis_name


def resolve_tp_mesh(group: Any, api: str, arg: str = "mp_group") -> TPMesh:
    """Returns the :class:`TPMesh` of ``group``.

    Args:
        group: what ``jaxpg.groups.resolve.resolve_group`` takes (a ``ProcessGroup``: a
            DeviceMesh dimension's group, ``new_group``'s, or one of ``new_subgroups``; a
            1-D ``DeviceMesh``, ``mesh["tp"]``), or a ``ParallelDims`` (its ``tp`` axis), a
            ``HybridCommunicateGroup`` (its model-parallel group), a ``TPMesh``, or None
            for the model-parallel group of the latest HybridCommunicateGroup (Paddle's
            default).
        api: the caller's name, for errors.
        arg: the argument's name, for errors (``device_mesh`` for ``parallelize_module``).

    Raises:
        ValueError: for a multi-dimensional DeviceMesh, a group that is not one dimension of a
            mesh, no HybridCommunicateGroup for None, or a process that holds no rank of it.
        TypeError: for anything else.
    """
    if isinstance(group, TPMesh):
        tp = group
    else:
        if group is None:
            group = get_hybrid_communicate_group()
        if isinstance(group, HybridCommunicateGroup):
            group = group.get_model_parallel_group()
        if isinstance(group, ParallelDims):
            group = group.get_group(group.axis("tp"))
        if group is NON_GROUP_MEMBER:
            raise ValueError(
                f"{api}: this process is not a member of the group "
                "(GroupMember.NON_GROUP_MEMBER); build the layer on ranks of its group only."
            )
        if not isinstance(group, ProcessGroup | DeviceMesh):
            raise devices_error(api, arg, group, _TP_FORMS)
        group = resolve_group(group, api=api, arg=arg)
        if group.mesh_dim is not None:
            mesh, axis = group.mesh_dim
        elif len(group.family) == 1:
            mesh, axis = group.jax_mesh, group.axis_name
        else:
            mesh, axis = _family_mesh(group, api)
        tp = TPMesh(mesh, axis)
    local = {d.id for d in jax.local_devices()}
    if not any(d.id in local for d in tp.mesh.devices.flat):
        ranks = _world.current().local_ranks if _world.is_initialized() else []
        raise ValueError(
            f"{api}: this process (ranks {ranks}) holds no rank of the tensor-parallel group "
            f"(devices {[d.id for d in tp.mesh.devices.flat]}); only its members may build or "
            "call its layers."
        )
    return tp


def in_spmd(tp: TPMesh, api: str) -> bool:
    """Whether the caller runs inside SPMD code that binds ``tp``'s axis (``shard_map``).

    Raises:
        ValueError: if the axis is bound with another size than the group's.
    """
    try:
        size = lax.axis_size(tp.axis)
    except NameError:
        return False
    if size != tp.size:
        raise ValueError(
            f"{api}: the running SPMD code binds axis {tp.axis!r} with size {size}, but the "
            f"tensor-parallel group has {tp.size} ranks; run it over the group's mesh."
        )
    return True
