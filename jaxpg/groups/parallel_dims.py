"""ParallelDims: every parallel degree of a job, validated once, building one DeviceMesh.

The one mesh type of jaxpg, as torchtitan's ``ParallelDims``: data parallelism replicated
(``dp_replicate``) and sharded (``dp_shard``, Paddle's ``sharding``), context parallelism
(``cp``, Paddle's ``sep``), tensor parallelism (``tp``, Paddle's ``mp``), the pipeline
(``pp``) and expert parallelism (``ep``, which borrows its ranks from ``dp_shard x cp``).

Rank order (Paddle's ``CommunicateTopology``, tensor parallelism innermost)::

    (dp_replicate, pp, dp_shard, cp, tp)

so ``rank = (((dp_replicate * pp + pp_coord) * dp_shard + dp_shard_coord) * cp + cp_coord)
* tp + tp_coord``. Every axis is in the mesh, of size 1 when unused, so ``mesh["tp"]``
always exists. Flattened dimensions are groups too:

* ``dp`` = ``dp_replicate x dp_shard`` (the batch is split over it),
* ``dp_shard_cp`` = ``dp_shard x cp`` (FSDP shards over it, torchtitan's),
* ``dp_cp`` = ``dp_replicate x dp_shard x cp`` (the loss is averaged over it),
* ``ep``: consecutive runs of ``ep`` ranks of ``dp_shard_cp``, and ``dp_shard_mod_ep`` (Paddle's
  ``moe_sharding``): the ranks of ``dp_shard_cp`` at the same ``ep`` position.

:class:`~jaxpg.HybridCommunicateGroup` is Paddle's face of the same value: it names the
axes ``dp, pp, sharding, sep, mp`` (``axis_names=PADDLE_AXIS_NAMES``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxpg.groups import world as _world
from jaxpg.groups.device_mesh import DeviceMesh
from jaxpg.groups.process_group import ProcessGroup

__all__ = ["ParallelDims", "TORCH_AXIS_NAMES", "PADDLE_AXIS_NAMES"]

_ORDER = ("dp_replicate", "pp", "dp_shard", "cp", "tp")
TORCH_AXIS_NAMES: Mapping[str, str] = {
    "dp_replicate": "dp_replicate", "pp": "pp", "dp_shard": "dp_shard", "cp": "cp", "tp": "tp",
    "dp": "dp", "dp_shard_cp": "dp_shard_cp", "dp_cp": "dp_cp", "ep": "ep",
    "dp_shard_mod_ep": "dp_shard_mod_ep"}
"""torchtitan's names of the axes and flattened dimensions (the default)."""
PADDLE_AXIS_NAMES: Mapping[str, str] = {
    "dp_replicate": "dp", "pp": "pp", "dp_shard": "sharding", "cp": "sep", "tp": "mp",
    "dp": "dp_sharding", "dp_shard_cp": "sharding_sep", "dp_cp": "dp_sep_sharding",
    "ep": "ep", "dp_shard_mod_ep": "moe_sharding"}
"""Paddle's names (``HybridCommunicateGroup``'s): data, pipe, sharding, sep, model."""
_FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
              "dp_cp": ("dp_replicate", "dp_shard", "cp")}


@dataclasses.dataclass(kw_only=True)
class ParallelDims:
    """The parallel degrees of a job over the world, and the one mesh they make.

    Args:
        dp_replicate: replicated data parallelism (DDP, HSDP's replicas).
        dp_shard: sharded data parallelism (FSDP / ZeRO; Paddle's ``sharding``); -1 takes
            what the other degrees leave of the world.
        cp: context parallelism (Paddle's ``sep``).
        tp: tensor parallelism (Paddle's ``mp``).
        pp: pipeline parallelism.
        ep: expert parallelism; borrows its ranks from ``dp_shard x cp`` (it must divide
            it), so it does not enter the world size.
        world_size: the number of ranks; None for the world's (``init_process_group`` is
            called if needed, as ``init_device_mesh`` does).
        axis_names: the mesh's name for each degree and flattened dimension
            (``TORCH_AXIS_NAMES``, the default, or ``PADDLE_AXIS_NAMES``).

    Raises:
        ValueError: a degree that is not an int >= 1 (-1 for dp_shard), degrees whose
            product is not the world size, or an ``ep`` that does not divide ``dp_shard x cp``.

    Example:
        >>> dims = jaxpg.ParallelDims(dp_shard=2, tp=4)      # 8 ranks
        >>> dims.device_mesh["tp"].mesh.tolist()              # acting as rank 0
        [0, 1, 2, 3]
        >>> dims.get_group("dp_shard").ranks
        (0, 4)
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    world_size: int | None = None
    axis_names: Mapping[str, str] = dataclasses.field(
        default_factory=lambda: TORCH_AXIS_NAMES, repr=False)
    _device_mesh: DeviceMesh | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or (
                    v < 1 and not (name == "dp_shard" and v == -1)):
                also = " (or -1: what the other degrees leave)" if name == "dp_shard" else ""
                raise ValueError(f"ParallelDims: {name}={v!r} must be an int >= 1{also}.")
        missing = set(TORCH_AXIS_NAMES) - set(self.axis_names)
        if missing:
            raise ValueError(f"ParallelDims: axis_names lacks {sorted(missing)}; start from "
                             "TORCH_AXIS_NAMES or PADDLE_AXIS_NAMES.")
        if self.world_size is None:
            if not _world.is_initialized():
                _world.init_process_group()
            self.world_size = len(_world.current().devices)
        world = self.world_size
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if world % others:
                raise ValueError(
                    f"ParallelDims: dp_replicate={self.dp_replicate} x cp={self.cp} x "
                    f"tp={self.tp} x pp={self.pp} = {others} does not divide the world size "
                    f"{world}, so dp_shard=-1 has no value; change the degrees.")
            self.dp_shard = world // others
        if self.product != world:
            raise ValueError(
                f"ParallelDims: {self._shown()} = {self.product} must equal the world size "
                f"{world}; change the degrees (dp_shard=-1 takes what the others leave).")
        if (self.dp_shard * self.cp) % self.ep:
            raise ValueError(
                f"ParallelDims: ep={self.ep} must divide dp_shard x cp = "
                f"{self.dp_shard * self.cp} (dp_shard={self.dp_shard}, cp={self.cp}): expert "
                "parallelism borrows its ranks from them, as torchtitan's does.")

    def _shown(self) -> str:
        return " x ".join(f"{n}={getattr(self, n)}" for n in _ORDER)

    @property
    def product(self) -> int:
        """``dp_replicate x pp x dp_shard x cp x tp`` (the world size; ep is borrowed)."""
        return math.prod(getattr(self, n) for n in _ORDER)

    @property
    def dp(self) -> int:
        """The data-parallel degree ``dp_replicate x dp_shard`` (the batch's splits)."""
        return self.dp_replicate * self.dp_shard

    def axis(self, degree: str) -> str:
        """The mesh's name for ``degree`` (``"tp"`` -> ``"mp"`` with Paddle's names)."""
        return self.axis_names[degree]

    @property
    def device_mesh(self) -> DeviceMesh:
        """The DeviceMesh of every axis in rank order, with the flattened dimensions (built
        once, on first use)."""
        if self._device_mesh is None:
            self._device_mesh = self._build()
        return self._device_mesh

    @property
    def jax_mesh(self) -> Any:
        """The ``jax.sharding.Mesh`` of :attr:`device_mesh`."""
        return self.device_mesh.jax_mesh

    def _build(self) -> DeviceMesh:
        if not _world.is_initialized():
            _world.init_process_group()
        world = len(_world.current().devices)
        if world != self.world_size:
            raise ValueError(f"ParallelDims: world_size={self.world_size} but the world has "
                             f"{world} ranks; build it after init_process_group.")
        shape = tuple(getattr(self, n) for n in _ORDER)
        mesh = DeviceMesh(np.arange(world).reshape(shape), [self.axis(n) for n in _ORDER])
        for flat, dims in _FLATTENED.items():
            mesh[tuple(self.axis(d) for d in dims)]._flatten(self.axis(flat))
        rows = mesh._flat[self.axis("dp_shard_cp")]  # (others, dp_shard * cp)
        chunks = rows.reshape(rows.shape[0], -1, self.ep)
        mesh._add_flat_dim(self.axis("ep"), chunks.reshape(-1, self.ep))
        mesh._add_flat_dim(self.axis("dp_shard_mod_ep"),
                           np.swapaxes(chunks, 1, 2).reshape(-1, chunks.shape[1]))
        return mesh

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        """``dims["tp"]``: the same as ``dims.device_mesh["tp"]``."""
        return self.device_mesh[names]

    def get_group(self, name: str) -> ProcessGroup:
        """The acting rank's group along axis or flattened dimension ``name``."""
        return self.device_mesh.get_group(name)
