"""The expert-parallel group: which ranks share the experts, and the mesh axis they span.

One function, :func:`resolve_ep_group`, turns what a user passes as ``group=`` (a
ProcessGroup, a 1-D DeviceMesh such as ``mesh["ep"]``, a whole ``ParallelDims`` or
``HybridCommunicateGroup`` for its expert-parallel group, or None for the world) into the
:class:`EPGroup` the rest of the package uses, through the project's resolver
(:func:`jaxpg.groups.resolve.resolve_degree_group`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from jaxpg.groups.process_group import ProcessGroup
from jaxpg.groups.resolve import resolve_degree_group
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
            ``new_subgroups``), a 1-D ``DeviceMesh``, a ``ParallelDims`` or
            ``HybridCommunicateGroup`` (its expert-parallel group), an ``EPGroup``, or None
            for the world.
        api: the caller's name, for errors.

    Raises:
        ValueError: for a DeviceMesh of several dimensions, or subgroups of uneven sizes
            (not one dimension of a mesh).
        TypeError: for anything else.
    """
    if isinstance(group, EPGroup):
        return group
    pg = resolve_degree_group(group, "ep", api=api)
    try:
        tp = resolve_tp_mesh(pg, api, arg="group")
    except ValueError as err:  # the tensor-parallel wording, said for experts
        raise ValueError(str(err).replace("tensor-parallel", "expert-parallel")
                         .replace("tensor parallelism", "expert parallelism")) from None
    return EPGroup(pg, tp.mesh, tp.axis)
