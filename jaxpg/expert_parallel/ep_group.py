"""The expert-parallel group: which ranks share the experts, and the mesh axis they span.

One function, :func:`resolve_ep_group`, turns what a user passes as ``group=`` (a
ProcessGroup, a 1-D DeviceMesh such as ``mesh["ep"]``, or None for the world) into the
:class:`EPGroup` the rest of the package uses, so that it can later be switched to the
project's shared group/mesh resolver in one place.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from jaxpg.groups import world as _world
from jaxpg.groups.device_mesh import DeviceMesh
from jaxpg.groups.process_group import ProcessGroup
from jaxpg.tensor_parallel.tp_mesh import resolve_tp_mesh

__all__ = ["EPGroup", "resolve_ep_group"]


@dataclasses.dataclass(frozen=True)
class EPGroup:
    """An expert-parallel group.

    Attributes:
        group: the ProcessGroup whose collectives carry the tokens.
        mesh: the ``jax.sharding.Mesh`` of the whole topology the group is a dimension of
            (the experts' parameters are laid out on it).
        axis: the name of the expert-parallel axis of ``mesh``.
    """

    group: ProcessGroup
    mesh: Mesh
    axis: str

    @property
    def size(self) -> int:
        """The expert-parallel degree."""
        return self.group.size()


def resolve_ep_group(group: Any, api: str) -> EPGroup:
    """Returns the :class:`EPGroup` of ``group``.

    Args:
        group: a ``ProcessGroup`` (``mesh["ep"]``'s, ``new_group``'s, one of
            ``new_subgroups``), a 1-D ``DeviceMesh``, an ``EPGroup``, or None for the world.
        api: the caller's name, for errors.

    Raises:
        ValueError: for a DeviceMesh of several dimensions, or subgroups of uneven sizes
            (not one dimension of a mesh).
        TypeError: for anything else.
    """
    if isinstance(group, EPGroup):
        return group
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"{api}: group is a DeviceMesh with {group.ndim} dimensions "
                f"{group.mesh_dim_names}; experts are split over one dimension of a mesh: "
                f"pass one of them, e.g. group=mesh[{group.mesh_dim_names[-1]!r}]."
            )
        group = group.get_group()
    if group is not None and not isinstance(group, ProcessGroup):
        raise TypeError(f"{api}: group must be a jaxpg ProcessGroup, a 1-D DeviceMesh "
                        f"(mesh['ep']) or None for the world; got {type(group).__name__}.")
    pg = _world._resolve_group(group, api)
    try:
        tp = resolve_tp_mesh(pg, api, arg="group")
    except ValueError as err:  # the tensor-parallel wording, said for experts
        raise ValueError(str(err).replace("tensor-parallel", "expert-parallel")
                         .replace("tensor parallelism", "expert parallelism")) from None
    return EPGroup(pg, tp.mesh, tp.axis)
