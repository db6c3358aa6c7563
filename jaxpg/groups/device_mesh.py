"""DeviceMesh: named mesh dimensions over the world's ranks, as torch's ``init_device_mesh``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cached_property

import jax
import numpy as np
from jax.sharding import Mesh

from jaxpg.groups import world as _world
from jaxpg.groups.process_group import ProcessGroup

__all__ = ["DeviceMesh", "init_device_mesh"]

_DEVICE_TYPES = {"cpu": ("cpu",), "cuda": ("gpu", "cuda"), "gpu": ("gpu", "cuda"),
                 "tpu": ("tpu",), "rocm": ("gpu", "rocm")}


class DeviceMesh:
    """An n-dimensional arrangement of global ranks with named dimensions.

    ``mesh["dp"]`` is the 1-D sub-mesh along ``dp`` that holds the acting rank, and
    ``mesh.get_group("dp")`` the ProcessGroup of that dimension: one group per position of
    the other dimensions, forming a family (see ProcessGroup), so inside ``jaxpg.spmd(...,
    mesh=mesh)`` a collective on it lowers to ``lax`` collectives on the axis ``"dp"``.
    ``jax_mesh`` is the ``jax.sharding.Mesh`` with the same axis names, for ``shard_map``;
    ``mesh`` is torch's name for the array of global ranks (``ranks`` says the same).

    Besides its dimensions, a mesh may name *flattened* dimensions,
    ``mesh["dp_shard", "cp"].flatten("dp_shard_cp")`` (torch's ``_flatten`` works too):
    ``mesh["dp_shard_cp"]`` is then the 1-D mesh over the acting rank's ranks of those
    dimensions (row-major in the order named), and its group a family over the whole mesh,
    like any dimension's.
    ``jaxpg.ParallelDims`` names its flattened dimensions (``dp``, ``dp_shard_cp``, ``ep``)
    this way.
    """

    def __init__(self, ranks: np.ndarray, mesh_dim_names: Sequence[str]):
        self._state = _world.current()
        self.mesh = np.asarray(ranks, dtype=np.int64)
        self.mesh_dim_names = tuple(mesh_dim_names)
        self._groups: dict[str, list[ProcessGroup]] = {}
        # flattened dimensions: name -> rows of global ranks (one row per group of the family)
        self._flat: dict[str, np.ndarray] = {}
        self._root: DeviceMesh = self

    @property
    def ranks(self) -> np.ndarray:
        """The array of global ranks, one per position (torch calls it ``mesh``)."""
        return self.mesh

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape)

    @property
    def ndim(self) -> int:
        return self.mesh.ndim

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Number of ranks in the mesh, or along one dimension."""
        if mesh_dim is None:
            return int(self.mesh.size)
        if isinstance(mesh_dim, str) and mesh_dim in self._flat:
            return int(self._flat[mesh_dim].shape[1])
        return self.shape[self._dim(mesh_dim)]

    @cached_property
    def jax_mesh(self) -> Mesh:
        """The ``jax.sharding.Mesh`` over these ranks' devices, with the dimension names."""
        devs = np.vectorize(lambda r: self._state.devices[r], otypes=[object])(self.mesh)
        return Mesh(devs, self.mesh_dim_names)

    def _dim(self, mesh_dim: int | str) -> int:
        if isinstance(mesh_dim, str):
            if mesh_dim not in self.mesh_dim_names:
                flat = f" or the flattened {tuple(self._flat)}" if self._flat else ""
                raise KeyError(f"DeviceMesh: mesh_dim={mesh_dim!r} is not one of "
                               f"{self.mesh_dim_names}{flat}.")
            return self.mesh_dim_names.index(mesh_dim)
        if not 0 <= mesh_dim < self.ndim:
            raise ValueError(f"DeviceMesh: mesh_dim={mesh_dim} is out of range for a "
                             f"{self.ndim}-D mesh.")
        return mesh_dim

    def get_group(self, mesh_dim: int | str | None = None) -> ProcessGroup:
        """The group along ``mesh_dim`` holding the acting rank (its family spans the mesh)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError("DeviceMesh.get_group: name mesh_dim for a mesh of "
                                 f"{self.ndim} dimensions {self.mesh_dim_names}.")
            mesh_dim = 0
        if isinstance(mesh_dim, str) and mesh_dim in self._flat:
            name, rows, axis = mesh_dim, self._flat[mesh_dim], None
        else:
            d = self._dim(mesh_dim)
            name, axis = self.mesh_dim_names[d], self.mesh_dim_names[d]
            rows = np.moveaxis(self.mesh, d, -1).reshape(-1, self.shape[d])
        if name not in self._groups:
            family = tuple(tuple(int(r) for r in row) for row in rows)
            prefix = self._state.next_group_name(f"mesh_{name}_")
            groups = [ProcessGroup(self._state, row, family=family, name=f"{prefix}_{i}")
                      for i, row in enumerate(family)]
            for g in groups:
                if axis is not None:  # one axis of the jax mesh (a flattened one is several)
                    g.mesh_dim = (self.jax_mesh, axis)
                self._state.groups[g.group_name] = g
            self._groups[name] = groups
        groups = self._groups[name]
        acting = self._state.acting_rank()
        return next((g for g in groups if acting in g.ranks), groups[0])

    def _as_process_group(self, api: str, arg: str) -> ProcessGroup:
        """The group of a 1-D mesh, for ``group=`` arguments (see ``resolve_group``)."""
        if self.ndim != 1:
            raise ValueError(
                f"{api}: {arg}= runs over one axis, but got a {self.ndim}-D DeviceMesh with "
                f"dimensions {self.mesh_dim_names}; pass one of them: "
                + " or ".join(f"{arg}=mesh[{n!r}]" for n in self.mesh_dim_names) + "."
            )
        return self.get_group()

    def get_all_groups(self) -> list[ProcessGroup]:
        return [self.get_group(n) for n in self.mesh_dim_names]

    def get_coordinate(self) -> list[int] | None:
        """The acting rank's coordinates in the mesh, or None if it is not in it."""
        where = np.argwhere(self.mesh == self._state.acting_rank())
        return None if where.size == 0 else [int(c) for c in where[0]]

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """The acting rank's coordinate along ``mesh_dim``."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError("DeviceMesh.get_local_rank: name mesh_dim for an n-D mesh.")
            mesh_dim = 0
        if isinstance(mesh_dim, str) and mesh_dim in self._flat:
            return self.get_group(mesh_dim).rank()
        coord = self.get_coordinate()
        if coord is None:
            raise ValueError("DeviceMesh.get_local_rank: the acting rank is not in this mesh.")
        return coord[self._dim(mesh_dim)]

    def get_rank(self) -> int:
        return self._state.acting_rank()

    def __getitem__(self, names: str | Sequence[str]) -> DeviceMesh:
        names = (names,) if isinstance(names, str) else tuple(names)
        if len(names) == 1 and names[0] in self._flat:
            group = self.get_group(names[0])
            child = DeviceMesh(np.asarray(group.ranks), names)
            child._groups[names[0]] = self._groups[names[0]]
            child._root = self._root
            return child
        dims = [self._dim(n) for n in names]
        coord = self.get_coordinate() or [0] * self.ndim
        index = tuple(slice(None) if i in dims else coord[i] for i in range(self.ndim))
        kept = sorted(dims)  # the order the indexed array keeps them in
        sub = np.transpose(self.mesh[index], [kept.index(d) for d in dims])
        child = DeviceMesh(sub, names)
        child._root = self._root
        child._flat_dims = tuple(names)
        for n in names:  # a sub-mesh's groups are the parent's, so families stay whole
            self.get_group(n)
            child._groups[n] = self._groups[n]
        return child

    def flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """Flattens this (sub-)mesh's dimensions into one named dimension of the root mesh.

        ``mesh["dp_shard", "cp"].flatten("dp_shard_cp")``: afterwards ``root["dp_shard_cp"]``
        is a 1-D mesh and ``root.get_group("dp_shard_cp")`` its group. ``_flatten`` is the
        same method under torch's name.

        Args:
            mesh_dim_name: the new dimension's name (default: the names joined by ``_``).

        Returns:
            The flattened 1-D mesh.
        """
        names = getattr(self, "_flat_dims", self.mesh_dim_names)
        name = mesh_dim_name or "_".join(names)
        root = self._root
        if name in root.mesh_dim_names:
            raise ValueError(f"DeviceMesh.flatten: mesh_dim_name={name!r} is already a "
                             f"dimension of the mesh {root.mesh_dim_names}; pick another name.")
        dims = [root._dim(n) for n in names]
        others = [i for i in range(root.ndim) if i not in dims]
        size = int(np.prod([root.shape[d] for d in dims]))
        rows = np.transpose(root.mesh, others + dims).reshape(-1, size)
        root._add_flat_dim(name, rows)
        return root[name]

    _flatten = flatten  # torch's spelling: mesh["dp", "cp"]._flatten("dp_cp")

    def _add_flat_dim(self, name: str, rows: np.ndarray) -> None:
        """Names a partition of the mesh's ranks into equal rows as a flattened dimension."""
        rows = np.asarray(rows, dtype=np.int64)
        if sorted(rows.reshape(-1).tolist()) != sorted(self.mesh.reshape(-1).tolist()):
            raise ValueError(f"DeviceMesh: the rows of {name!r} do not partition the mesh.")
        old = self._flat.get(name)
        if old is not None and not np.array_equal(old, rows):
            raise ValueError(f"DeviceMesh: {name!r} is already flattened from other ranks.")
        self._flat[name] = rows

    def __repr__(self) -> str:
        return f"DeviceMesh({self.mesh.tolist()}, mesh_dim_names={self.mesh_dim_names})"


def init_device_mesh(device_type: str | Sequence[int], mesh_shape: Sequence[int] | None = None,
                     *, mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
    """Arranges the world's ranks (row-major) into a mesh with named dimensions.

    Accepts torch's ``init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "pp"))`` and the
    shorter ``init_device_mesh((2, 4), ("dp", "pp"))``. Initialises the default group first
    if needed, as torch does.
    """
    if not isinstance(device_type, str):
        if mesh_shape is not None and mesh_dim_names is None:
            mesh_dim_names = mesh_shape
        device_type, mesh_shape = None, device_type
    if device_type is not None:
        platform = jax.default_backend()
        if device_type.lower() not in _DEVICE_TYPES:
            raise ValueError(f"init_device_mesh: device_type={device_type!r} is not known; use "
                             f"one of {sorted(_DEVICE_TYPES)}.")
        if platform not in _DEVICE_TYPES[device_type.lower()]:
            raise ValueError(f"init_device_mesh: device_type={device_type!r} does not match "
                             f"JAX's platform {platform!r}.")
    if mesh_shape is None:
        raise ValueError("init_device_mesh: mesh_shape is required.")
    shape = tuple(int(s) for s in mesh_shape)
    if not _world.is_initialized():
        _world.init_process_group()
    state = _world.current()
    if any(s <= 0 for s in shape) or math.prod(shape) != len(state.devices):
        raise ValueError(f"init_device_mesh: mesh_shape={shape} must multiply to the world size "
                         f"{len(state.devices)}.")
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else tuple(
        f"dim{i}" for i in range(len(shape)))
    if len(names) != len(shape) or len(set(names)) != len(names):
        raise ValueError(f"init_device_mesh: mesh_dim_names={names} must be {len(shape)} "
                         "distinct names.")
    return DeviceMesh(np.arange(len(state.devices)).reshape(shape), names)
