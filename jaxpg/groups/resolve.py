"""The one resolver of every argument that names devices.

An API that runs over **one axis** takes ``group=``: a ``ProcessGroup``, a 1-D
``DeviceMesh`` (``mesh["dp"]``, a flattened ``mesh["dp_shard_cp"]``) or None for the world;
:func:`resolve_group` turns it into the ``ProcessGroup``. An API that runs over **several
axes** takes ``mesh=``: a ``DeviceMesh``, a ``HybridCommunicateGroup``, a ``ParallelDims``
or a ``jax.sharding.Mesh``; :func:`resolve_mesh` turns it into the ``jax.sharding.Mesh``
(and :func:`resolve_device_mesh` into the ``DeviceMesh``, for APIs that need its groups).
Anything else gets one error text, naming the API, the argument, what was passed and what
to pass (:func:`devices_error`, in ``world.py`` so that the world's own calls share it).
"""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh

from jaxpg.groups import world as _world
from jaxpg.groups.device_mesh import DeviceMesh
from jaxpg.groups.hybrid import HybridCommunicateGroup
from jaxpg.groups.parallel_dims import ParallelDims
from jaxpg.groups.process_group import ProcessGroup
from jaxpg.groups.world import GROUP_FORMS, devices_error

__all__ = ["GROUP_FORMS", "MESH_FORMS", "devices_error", "resolve_group", "resolve_mesh",
           "resolve_device_mesh", "resolve_degree_group"]

MESH_FORMS = "a DeviceMesh, a HybridCommunicateGroup, a ParallelDims or a jax.sharding.Mesh"
"""What an argument naming several axes (``mesh=``) accepts."""


def resolve_group(group: Any, *, api: str, arg: str = "group") -> ProcessGroup:
    """The ``ProcessGroup`` that ``group`` names (one axis; None is the world).

    Raises:
        ValueError: for ``GroupMember.NON_GROUP_MEMBER``, a DeviceMesh of several
            dimensions, or a group of a destroyed world.
        TypeError: for anything that is not one of :data:`GROUP_FORMS`.
    """
    return _world._resolve_group(group, api, arg)


_HCG_GETTERS = {"dp": "get_data_parallel_group", "pp": "get_pipe_parallel_group",
                "dp_shard": "get_sharding_parallel_group", "cp": "get_sep_parallel_group",
                "tp": "get_model_parallel_group", "ep": "get_expert_parallel_group"}


def resolve_degree_group(group: Any, degree: str, *, api: str,
                         arg: str = "group") -> ProcessGroup:
    """The ``ProcessGroup`` of parallelism ``degree`` (``"cp"``, ``"ep"``, ``"tp"``, ...)
    that ``group`` names.

    A whole topology, a ``ParallelDims`` or a ``HybridCommunicateGroup``, gives its
    ``degree`` group (``dims.get_group(dims.axis("cp"))``, ``hcg.get_sep_parallel_group()``);
    anything else is :func:`resolve_group`'s.

    Raises:
        ValueError, TypeError: as :func:`resolve_group`.
    """
    if isinstance(group, ParallelDims):
        return group.get_group(group.axis(degree))
    if isinstance(group, HybridCommunicateGroup):
        return getattr(group, _HCG_GETTERS[degree])()
    return resolve_group(group, api=api, arg=arg)


def resolve_device_mesh(mesh: Any, *, api: str, arg: str = "mesh") -> DeviceMesh:
    """The ``DeviceMesh`` that ``mesh`` names (a jax Mesh is mapped to the world's ranks).

    Raises:
        TypeError: for anything that is not one of :data:`MESH_FORMS`.
        ValueError: for a jax Mesh with devices outside the world.
    """
    if isinstance(mesh, DeviceMesh):
        return mesh
    if isinstance(mesh, HybridCommunicateGroup):
        return mesh.device_mesh
    if isinstance(mesh, ParallelDims):
        return mesh.device_mesh
    if isinstance(mesh, Mesh):
        import numpy as np

        if not _world.is_initialized():
            _world.init_process_group()
        state = _world.current()
        try:
            ranks = np.vectorize(state.rank_of_device, otypes=[np.int64])(mesh.devices)
        except (KeyError, ValueError) as e:
            raise ValueError(f"{api}: {arg}={mesh!r} holds devices outside the world "
                             f"({e}); build it over jax.devices().") from None
        return DeviceMesh(ranks, mesh.axis_names)
    raise devices_error(api, arg, mesh, MESH_FORMS)


def resolve_mesh(mesh: Any, *, api: str, arg: str = "mesh") -> Mesh:
    """The ``jax.sharding.Mesh`` that ``mesh`` names (a jax Mesh is returned as it is).

    Raises:
        TypeError: for anything that is not one of :data:`MESH_FORMS`.
    """
    if isinstance(mesh, Mesh):
        return mesh
    if isinstance(mesh, HybridCommunicateGroup | ParallelDims | DeviceMesh):
        return resolve_device_mesh(mesh, api=api, arg=arg).jax_mesh
    raise devices_error(api, arg, mesh, MESH_FORMS)


def data_parallel_axis(mesh: Any, dp_axis: str | None) -> str | None:
    """The one data-parallel axis of ``mesh`` for APIs that take one (the pipeline's).

    ``dp_axis`` itself when the mesh has it or ``mesh`` is not a ``ParallelDims`` (nor a
    HybridCommunicateGroup made from one); otherwise the ParallelDims' ``dp_replicate``
    axis, or its ``dp_shard`` axis when only that one is larger than 1.

    Raises:
        ValueError: for a ParallelDims with both ``dp_replicate`` and ``dp_shard`` above 1.
    """
    dims = mesh if isinstance(mesh, ParallelDims) else getattr(mesh, "parallel_dims", None)
    if not isinstance(dims, ParallelDims) or dp_axis in dims.device_mesh.mesh_dim_names:
        return dp_axis
    if dims.dp_replicate > 1 and dims.dp_shard > 1:
        raise ValueError(
            f"mesh={dims!r} has two data-parallel axes ({dims.axis('dp_replicate')!r} and "
            f"{dims.axis('dp_shard')!r}); name the one to run over with dp_axis=.")
    return dims.axis("dp_shard" if dims.dp_shard > 1 else "dp_replicate")


def one_of(api: str, **given: Any) -> Any:
    """The one of several spellings of the same argument that was passed (torch's
    ``device_mesh=`` beside ``group=``), or None.

    Raises:
        ValueError: if more than one was passed.
    """
    passed = {k: v for k, v in given.items() if v is not None}
    if len(passed) > 1:
        raise ValueError(f"{api}: pass one of {', '.join(f'{k}=' for k in given)}, not "
                         f"{' and '.join(f'{k}=' for k in passed)}: they name the same devices.")
    return next(iter(passed.values()), None)
