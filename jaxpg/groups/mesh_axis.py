"""A group as one axis of the topology's mesh: the record every parallelism computes with.

Tensor, context and expert parallelism lay their arrays out with a ``NamedSharding`` on the
mesh of the *whole* topology (a ``("dp", "tp")`` DeviceMesh, a HybridCommunicateGroup's
``("dp", "pp", "mp")`` mesh), split over one axis of it and replicated over the others, so
data parallelism and the pipeline, which run over that same mesh, find them where they
expect them. :func:`resolve_mesh_axis` turns what a user passes as a group (a ProcessGroup,
a 1-D DeviceMesh, ``new_subgroups``' groups, a whole ``ParallelDims`` or
``HybridCommunicateGroup``) into that axis, the :class:`MeshAxis`: the one resolver of a
parallelism's group, for every degree (``"tp"``, ``"cp"``, ``"ep"``).
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
from jaxpg.groups.resolve import devices_error, resolve_degree_group

__all__ = ["MeshAxis", "resolve_mesh_axis", "ROLES"]

ROLES = {"tp": "tensor-parallel", "cp": "context-parallel", "ep": "expert-parallel"}
"""Each degree's adjective, as errors say it."""

_NONE_IS = {"tp": "the latest HybridCommunicateGroup's mp group"}  # else the world


def _forms(degree: str) -> str:
    none = _NONE_IS.get(degree, "the world")
    hcg = "its mp group" if degree == "tp" else f"its {degree} group"
    return (f"a ProcessGroup, a 1-D DeviceMesh (mesh[{degree!r}]), a ParallelDims (its "
            f"{degree} axis), a HybridCommunicateGroup ({hcg}) or None ({none})")


@dataclasses.dataclass(frozen=True)
class MeshAxis:
    """A parallelism's group as one axis of the topology's mesh.

    Attributes:
        mesh: the ``jax.sharding.Mesh`` of the whole topology.
        axis: the name of the group's axis on ``mesh``.
        group: the ``ProcessGroup`` whose collectives run over the axis (None when built
            from a ``(mesh, axis)`` pair).
        role: the degree (``"tp"``, ``"cp"``, ``"ep"``), for errors.
    """

    mesh: Mesh
    axis: str
    group: ProcessGroup | None = None
    role: str = "tp"

    @property
    def size(self) -> int:
        """The group's size: the axis' length."""
        return int(self.mesh.shape[self.axis])

    def rank(self) -> int:
        """The acting rank's coordinate along the axis (host code; see ``jaxpg.as_rank``)."""
        state = _world.current()
        acting = state.devices[state.acting_rank()]
        where = np.argwhere(np.asarray(self.mesh.devices) == acting)
        if where.size == 0:
            raise ValueError(
                f"the acting rank {state.acting_rank()} is not on the {ROLES[self.role]} "
                f"mesh (devices {[d.id for d in self.mesh.devices.flat]}); act as one of its "
                "ranks (jaxpg.as_rank) or use a group that holds it."
            )
        return int(where[0][self.mesh.axis_names.index(self.axis)])

    def in_spmd(self, api: str) -> bool:
        """Whether the caller runs inside SPMD code that binds :attr:`axis` (``shard_map``).

        Raises:
            ValueError: if the axis is bound with another size than the group's.
        """
        return self._bound(self.axis, api, "run it over the group's mesh.")

    def bound_axis(self, api: str) -> str | None:
        """The axis name the running SPMD code binds for this group, or None in host code.

        SPMD code over the topology's mesh (``jaxpg.spmd(mesh=...)``, ``jax.shard_map``, DDP
        and FSDP steps) binds :attr:`axis`; ``jaxpg.spmd(fn, group=g)`` binds ``g``'s own
        axis name.

        Raises:
            ValueError: if the axis is bound with another size than the group's.
        """
        names = [self.axis]
        if self.group is not None and self.group.axis_name != self.axis:
            names.append(self.group.axis_name)
        fix = (f"run it over the group's mesh (jaxpg.spmd(fn, group={self.role}_group) or "
               "spmd(mesh=mesh, ...)).")
        return next((n for n in names if self._bound(n, api, fix)), None)

    def _bound(self, name: str, api: str, fix: str) -> bool:
        try:
            size = lax.axis_size(name)
        except NameError:
            return False
        if size != self.size:
            raise ValueError(
                f"{api}: the running SPMD code binds axis {name!r} with size {size}, but the "
                f"{ROLES[self.role]} group has {self.size} ranks; {fix}"
            )
        return True

    def __repr__(self) -> str:
        return (f"MeshAxis(role={self.role!r}, axis={self.axis!r}, size={self.size}, "
                f"mesh={dict(self.mesh.shape)})")


def _family_mesh(group: ProcessGroup, api: str) -> tuple[Mesh, str]:
    """A group made by ``new_subgroups``: its family's rows become the axis."""
    sizes = {len(f) for f in group.family}
    if len(sizes) != 1:
        raise ValueError(
            f"{api}: group {group.group_name!r} belongs to a family of uneven subgroups "
            f"{[list(f) for f in group.family]}, which is not one dimension of a mesh; use a "
            "DeviceMesh dimension (init_device_mesh(...)[...]) or equal-sized subgroups."
        )
    devices = np.array([[group._world.devices[r] for r in row] for row in group.family],
                       dtype=object)
    return Mesh(devices, (f"{group.axis_name}_others", group.axis_name)), group.axis_name


def resolve_mesh_axis(group: Any, degree: str, *, api: str, arg: str = "group") -> MeshAxis:
    """Returns the :class:`MeshAxis` of parallelism ``degree`` that ``group`` names.

    Args:
        group: a ``ProcessGroup`` (a DeviceMesh dimension's group, ``new_group``'s, one of
            ``new_subgroups``), a 1-D ``DeviceMesh`` (``mesh["tp"]``), a ``ParallelDims`` or
            a ``HybridCommunicateGroup`` (its ``degree`` group), a ``MeshAxis``, or None: for
            ``"tp"`` the model-parallel group of the latest HybridCommunicateGroup (Paddle's
            default), else the world.
        degree: ``"tp"``, ``"cp"`` or ``"ep"``.
        api: the caller's name, for errors.
        arg: the argument's name, for errors (``device_mesh`` for ``parallelize_module``).

    Raises:
        ValueError: for a multi-dimensional DeviceMesh, a group that is not one dimension of a
            mesh, no HybridCommunicateGroup for None, or a process that holds no rank of it.
        TypeError: for anything else.
    """
    role = ROLES[degree]
    if isinstance(group, MeshAxis):
        found = group
    else:
        if group is None and degree in _NONE_IS:
            group = get_hybrid_communicate_group()
        if arg != "group" and isinstance(group, DeviceMesh) and group.ndim > 1:
            names = tuple(group.mesh_dim_names or ())
            raise ValueError(
                f"{api}: {arg}= takes the {role} dimension, but got a {group.ndim}-D "
                f"DeviceMesh with dimensions {names}; pass {arg}=mesh[{degree!r}].")
        if group is NON_GROUP_MEMBER:
            raise ValueError(
                f"{api}: this process is not a member of the group "
                "(GroupMember.NON_GROUP_MEMBER); build the layer on ranks of its group only."
            )
        if not isinstance(group, ProcessGroup | DeviceMesh | ParallelDims
                          | HybridCommunicateGroup | None):
            raise devices_error(api, arg, group, _forms(degree))
        group = resolve_degree_group(group, degree, api=api, arg=arg)
        if group.mesh_dim is not None:
            mesh, axis = group.mesh_dim
        elif len(group.family) == 1:
            mesh, axis = group.jax_mesh, group.axis_name
        else:
            mesh, axis = _family_mesh(group, api)
        found = MeshAxis(mesh, axis, group, degree)
    local = {d.id for d in jax.local_devices()}
    if not any(d.id in local for d in found.mesh.devices.flat):
        ranks = _world.current().local_ranks if _world.is_initialized() else []
        raise ValueError(
            f"{api}: this process (ranks {ranks}) holds no rank of the {role} group "
            f"(devices {[d.id for d in found.mesh.devices.flat]}); only its members may build "
            "or call its layers."
        )
    return found
