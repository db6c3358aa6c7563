"""HybridCommunicateGroup: data-, pipeline-, sharding- and model-parallel groups, as Paddle's
hcg."""

from __future__ import annotations

from typing import Any

from jaxpg.groups import world as _world
from jaxpg.groups.device_mesh import DeviceMesh
from jaxpg.groups.parallel_dims import PADDLE_AXIS_NAMES, ParallelDims
from jaxpg.groups.process_group import ProcessGroup

__all__ = ["HybridCommunicateGroup", "get_hybrid_communicate_group"]

_PADDLE_DIMS = ("dp", "pp", "sharding", "sep", "mp")


class HybridCommunicateGroup:
    """Paddle's face of :class:`~jaxpg.ParallelDims`: ranks arranged as
    ``(dp, pp, sharding, sep, mp)``, model parallelism innermost.

    The same order as Paddle's ``CommunicateTopology(["data", "pipe", "sharding", "sep",
    "model"])``: ranks that differ only in their model-parallel coordinate are neighbours.
    It is a ``ParallelDims(dp_replicate=dp_degree, pp=pp_degree, dp_shard=sharding_degree,
    cp=sep_degree, tp=mp_degree, ep=ep_degree, axis_names=PADDLE_AXIS_NAMES)``
    (``parallel_dims``), whose DeviceMesh (``device_mesh``) has the dimensions ``"dp"``,
    ``"pp"``, ``"sharding"``, ``"sep"`` and ``"mp"``. The stage id is the pipeline coordinate;
    the previous and next pipeline ranks wrap around, as in Paddle. The sharding group is
    the one ZeRO / FSDP splits parameters, gradients and optimizer state over
    (``jaxpg.fsdp.FullyShardedDataParallel(group=hcg)`` replicates over ``dp`` and shards
    over ``sharding``); like ``dp`` ranks, sharding ranks train on different samples. The
    expert-parallel groups (``ep_degree``) are runs of ``ep_degree`` ranks of one
    ``sharding x sep`` group; the moe-sharding groups join the ranks at the same expert
    position.

    Args:
        dp_degree: data-parallel degree.
        pp_degree: pipeline-parallel degree.
        mp_degree: model-parallel degree.
        sharding_degree: sharding (ZeRO) degree.
        sep_degree: sequence (context) parallel degree.
        ep_degree: expert-parallel degree (divides ``sharding_degree x sep_degree``).
        mesh: instead of the degrees, a ``ParallelDims`` or an existing DeviceMesh with
            dimensions "dp", "pp", "sharding", "sep", "mp" (any subset).

    Example:
        >>> hcg = HybridCommunicateGroup(dp_degree=2, pp_degree=4)
        >>> hcg.get_pipe_parallel_world_size()
        4
    """

    def __init__(self, dp_degree: int = 1, pp_degree: int = 1, mp_degree: int = 1,
                 *, sharding_degree: int = 1, sep_degree: int = 1, ep_degree: int = 1,
                 mesh: Any = None):
        self.parallel_dims: ParallelDims | None = None
        if mesh is None:
            degrees = (("dp_degree", dp_degree), ("pp_degree", pp_degree),
                       ("sharding_degree", sharding_degree), ("sep_degree", sep_degree),
                       ("mp_degree", mp_degree), ("ep_degree", ep_degree))
            for name, v in degrees:
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"HybridCommunicateGroup: {name}={v!r} must be an int >= 1.")
            if not _world.is_initialized():
                _world.init_process_group()
            world = _world.current().world_group.size()
            total = dp_degree * pp_degree * sharding_degree * sep_degree * mp_degree
            if total != world:
                shown = " x ".join(f"{n}={v}" for n, v in degrees[:-1])
                raise ValueError(
                    f"HybridCommunicateGroup: {shown} = {total} must equal the world size "
                    f"{world}."
                )
            if (sharding_degree * sep_degree) % ep_degree:
                raise ValueError(
                    f"HybridCommunicateGroup: ep_degree={ep_degree} must divide "
                    f"sharding_degree x sep_degree = {sharding_degree * sep_degree}: expert "
                    "parallelism borrows its ranks from them.")
            mesh = ParallelDims(dp_replicate=dp_degree, pp=pp_degree, dp_shard=sharding_degree,
                                cp=sep_degree, tp=mp_degree, ep=ep_degree,
                                axis_names=PADDLE_AXIS_NAMES)
        if isinstance(mesh, ParallelDims):
            self.parallel_dims = mesh
            mesh = mesh.device_mesh
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"HybridCommunicateGroup: mesh= takes a ParallelDims or a "
                            f"DeviceMesh; got {type(mesh).__name__}.")
        unknown = set(mesh.mesh_dim_names) - set(_PADDLE_DIMS)
        if unknown:
            raise ValueError(f"HybridCommunicateGroup: mesh dimensions {sorted(unknown)} are "
                             f"not {', '.join(_PADDLE_DIMS)}.")
        self.device_mesh: DeviceMesh = mesh
        if {"dp", "sep"} <= set(mesh.mesh_dim_names) and "dp_sep" not in mesh._flat:
            mesh["dp", "sep"]._flatten("dp_sep")  # Paddle's fused data x sep group
        _world.current().hybrid_group = self  # the default of Paddle's mp layers

    @property
    def mesh(self) -> DeviceMesh:
        """The same as :attr:`device_mesh` (the name before ParallelDims; prefer
        ``device_mesh``)."""
        return self.device_mesh

    def _degree(self, dim: str) -> int:
        return self.device_mesh.size(dim) if dim in self.device_mesh.mesh_dim_names else 1

    def _rank(self, dim: str) -> int:
        return self.device_mesh.get_local_rank(dim) if dim in self.device_mesh.mesh_dim_names else 0

    def _group(self, dim: str) -> ProcessGroup:
        if dim not in self.device_mesh.mesh_dim_names:
            raise ValueError(f"HybridCommunicateGroup: the mesh has no {dim!r} dimension.")
        return self.device_mesh.get_group(dim)

    def get_global_rank(self) -> int:
        return self.device_mesh.get_rank()

    def get_data_parallel_world_size(self) -> int:
        return self._degree("dp")

    def get_data_parallel_rank(self) -> int:
        return self._rank("dp")

    def get_data_parallel_group(self) -> ProcessGroup:
        return self._group("dp")

    def get_model_parallel_world_size(self) -> int:
        return self._degree("mp")

    def get_model_parallel_rank(self) -> int:
        return self._rank("mp")

    def get_model_parallel_group(self) -> ProcessGroup:
        return self._group("mp")

    def get_pipe_parallel_world_size(self) -> int:
        return self._degree("pp")

    def get_pipe_parallel_rank(self) -> int:
        return self._rank("pp")

    def get_pipe_parallel_group(self) -> ProcessGroup:
        return self._group("pp")

    def get_sharding_parallel_world_size(self) -> int:
        return self._degree("sharding")

    @property
    def sharding_degree(self) -> int:
        """The sharding (ZeRO) degree, as Paddle's ``hcg.sharding_degree`` / strategy."""
        return self._degree("sharding")

    def get_sharding_parallel_rank(self) -> int:
        return self._rank("sharding")

    def get_sharding_parallel_group(self) -> ProcessGroup:
        """The acting rank's sharding group (a one-rank group with sharding_degree 1)."""
        return self._group("sharding")

    @property
    def sep_degree(self) -> int:
        """The sequence (context) parallel degree, as Paddle's ``hcg.sep_degree``."""
        return self._degree("sep")

    def get_sep_parallel_world_size(self) -> int:
        return self._degree("sep")

    def get_sep_parallel_rank(self) -> int:
        return self._rank("sep")

    def get_sep_parallel_group(self) -> ProcessGroup:
        """The acting rank's sep (context-parallel) group (one rank with sep_degree 1)."""
        return self._group("sep")

    def get_dp_sep_parallel_group(self) -> ProcessGroup:
        """The acting rank's fused data x sep group (Paddle's ``dp_sep`` group: gradients
        of a sequence-parallel model are averaged over it)."""
        return self._flat_group("dp_sep", "dp x sep")

    def get_dp_sep_parallel_world_size(self) -> int:
        return self._flat_group("dp_sep", "dp x sep").size()

    def _flat_group(self, name: str, what: str) -> ProcessGroup:
        if name not in self.device_mesh._flat:
            raise ValueError(f"HybridCommunicateGroup: {what} groups need the degrees "
                             "(HybridCommunicateGroup(..., ep_degree=...)) or a ParallelDims, "
                             "not a DeviceMesh.")
        return self.device_mesh.get_group(name)

    def get_expert_parallel_world_size(self) -> int:
        return self._flat_group("ep", "expert-parallel").size()

    def get_expert_parallel_rank(self) -> int:
        return self._flat_group("ep", "expert-parallel").rank()

    def get_expert_parallel_group(self) -> ProcessGroup:
        """The acting rank's expert-parallel group: ``ep_degree`` consecutive ranks of its
        ``sharding x sep`` group."""
        return self._flat_group("ep", "expert-parallel")

    def get_moe_sharding_parallel_world_size(self) -> int:
        return self._flat_group("moe_sharding", "moe-sharding").size()

    def get_moe_sharding_parallel_rank(self) -> int:
        return self._flat_group("moe_sharding", "moe-sharding").rank()

    def get_moe_sharding_parallel_group(self) -> ProcessGroup:
        """The ranks of the acting rank's ``sharding x sep`` group at its expert position:
        expert parameters are sharded over them."""
        return self._flat_group("moe_sharding", "moe-sharding")

    def get_stage_id(self) -> int:
        return self._rank("pp")

    def is_first_stage(self) -> bool:
        return self.get_stage_id() == 0

    def is_last_stage(self) -> bool:
        return self.get_stage_id() == self._degree("pp") - 1

    def _pp_neighbour(self, step: int) -> int:
        if "pp" not in self.device_mesh.mesh_dim_names:
            return self.get_global_rank()
        group = self._group("pp")
        stage = self.get_stage_id()
        return group.ranks[(stage + step) % group.size()]

    def get_p2p_prev_rank(self) -> int:
        """Global rank of the previous pipeline stage (wrapping), same dp and mp position."""
        return self._pp_neighbour(-1)

    def get_p2p_next_rank(self) -> int:
        """Global rank of the next pipeline stage (wrapping), same dp and mp position."""
        return self._pp_neighbour(+1)

    def __repr__(self) -> str:
        shown = "".join(f"{d}={self._degree(d)}, " for d in ("sharding", "sep")
                        if self._degree(d) > 1)  # shown when used
        return (f"HybridCommunicateGroup(dp={self._degree('dp')}, pp={self._degree('pp')}, "
                f"{shown}mp={self._degree('mp')})")


def get_hybrid_communicate_group() -> HybridCommunicateGroup:
    """The latest HybridCommunicateGroup of this world (Paddle's
    ``fleet.get_hybrid_communicate_group()``).

    Raises:
        ValueError: if none was created since ``init_process_group``.
    """
    hcg = _world.current().hybrid_group
    if hcg is None:
        raise ValueError(
            "get_hybrid_communicate_group: no HybridCommunicateGroup exists in this world; "
            "create one first, e.g. HybridCommunicateGroup(dp_degree=2, mp_degree=4), or pass "
            "the group explicitly (mp_group=...)."
        )
    return hcg
