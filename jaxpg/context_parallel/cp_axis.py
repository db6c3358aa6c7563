"""The context-parallel group as a mesh axis: the one place a ``group=`` argument is resolved.

Every API of this package turns its ``group`` argument into a :class:`CPAxis` through
:func:`resolve_cp_axis`: the project's resolver names the group
(:func:`jaxpg.groups.resolve.resolve_degree_group`: a ProcessGroup, a 1-D DeviceMesh such as
``mesh["cp"]``, ``new_subgroups``' groups, or a whole ``ParallelDims`` or
``HybridCommunicateGroup``, whose cp/sep group it takes), and the tensor-parallel one finds
its axis on the topology's mesh (:func:`jaxpg.tensor_parallel.resolve_tp_mesh`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax import lax
from jax.sharding import Mesh

from jaxpg.groups.device_mesh import DeviceMesh
from jaxpg.groups.process_group import ProcessGroup
from jaxpg.groups.resolve import resolve_degree_group
from jaxpg.tensor_parallel.tp_mesh import TPMesh, resolve_tp_mesh

__all__ = ["CPAxis", "resolve_cp_axis"]


@dataclasses.dataclass(frozen=True)
class CPAxis:
    """A context-parallel group.

    Attributes:
        mesh: the ``jax.sharding.Mesh`` of the whole topology the group is an axis of.
        axis: the name of the group's axis on ``mesh``.
        group: the ``ProcessGroup`` (None when given as a ``TPMesh``-like pair).
        size: the context-parallel degree.
    """

    mesh: Mesh
    axis: str
    group: ProcessGroup | None
    size: int

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
        for name in names:
            try:
                size = lax.axis_size(name)
            except NameError:
                continue
            if size != self.size:
                raise ValueError(
                    f"{api}: the running SPMD code binds axis {name!r} with size {size}, but "
                    f"the context-parallel group has {self.size} ranks; run it over the "
                    "group's mesh (jaxpg.spmd(fn, group=cp_group) or spmd(mesh=mesh, ...))."
                )
            return name
        return None


def _reworded(message: str) -> str:
    return (message.replace("tensor-parallel", "context-parallel")
            .replace("tensor parallelism", "context parallelism")
            .replace("mesh['tp']", "mesh['cp']").replace("tp_mesh = ", "cp_mesh = "))


def resolve_cp_axis(group: Any, api: str, arg: str = "group") -> CPAxis:
    """Returns the :class:`CPAxis` of ``group`` (the world group for None).

    ``arg`` is the argument's name in errors (``context_parallel`` for the wrappers).

    Raises:
        ValueError: a multi-dimensional DeviceMesh, a group that is not one dimension of a
            mesh (uneven ``new_subgroups``), or a process that holds none of its ranks.
        TypeError: anything that is not a group or a topology.
    """
    if isinstance(group, CPAxis):
        return group
    names = tuple(getattr(group, "mesh_dim_names", None) or ())
    if arg != "group" and isinstance(group, DeviceMesh) and group.ndim > 1:
        raise ValueError(
            f"{api}: {arg}= takes the context-parallel dimension, but got a {group.ndim}-D "
            f"DeviceMesh with dimensions {names}; pass {arg}=mesh['cp'] (and the "
            "data-parallel and cp dimensions flattened as the wrapper's group=).")
    try:
        if not isinstance(group, TPMesh):
            group = resolve_degree_group(group, "cp", api=api, arg=arg)
        tp = resolve_tp_mesh(group, api, arg=arg)
    except (ValueError, TypeError) as err:
        raise type(err)(_reworded(str(err))) from None
    pg = group if isinstance(group, ProcessGroup) else None
    return CPAxis(tp.mesh, tp.axis, pg, tp.size)
