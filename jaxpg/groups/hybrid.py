"""HybridCommunicateGroup: data-, pipeline- and model-parallel groups, as Paddle's hcg."""

from __future__ import annotations

from jaxpg.groups import world as _world
from jaxpg.groups.device_mesh import DeviceMesh, init_device_mesh
from jaxpg.groups.process_group import ProcessGroup

__all__ = ["HybridCommunicateGroup", "get_hybrid_communicate_group"]


class HybridCommunicateGroup:
    """The hybrid topology: ranks arranged as ``(dp, pp, mp)``, model parallelism innermost.

    The same order as Paddle's ``CommunicateTopology(["data", "pipe", "model"])``: ranks that
    differ only in their model-parallel coordinate are neighbours. The stage id is the
    pipeline coordinate; the previous and next pipeline ranks wrap around, as in Paddle.

    Args:
        dp_degree: data-parallel degree.
        pp_degree: pipeline-parallel degree.
        mp_degree: model-parallel degree.
        mesh: an existing DeviceMesh with dimensions "dp", "pp", "mp" (any subset), instead
            of the degrees.

    Example:
        >>> hcg = HybridCommunicateGroup(dp_degree=2, pp_degree=4)
        >>> hcg.get_pipe_parallel_world_size()
        4
    """

    def __init__(self, dp_degree: int = 1, pp_degree: int = 1, mp_degree: int = 1,
                 *, mesh: DeviceMesh | None = None):
        if mesh is None:
            for name, v in (("dp_degree", dp_degree), ("pp_degree", pp_degree),
                            ("mp_degree", mp_degree)):
                if not isinstance(v, int) or v < 1:
                    raise ValueError(f"HybridCommunicateGroup: {name}={v!r} must be an int >= 1.")
            world = _world.current().world_group.size() if _world.is_initialized() else None
            if world is not None and dp_degree * pp_degree * mp_degree != world:
                raise ValueError(
                    f"HybridCommunicateGroup: dp_degree={dp_degree} x pp_degree={pp_degree} x "
                    f"mp_degree={mp_degree} = {dp_degree * pp_degree * mp_degree} must equal "
                    f"the world size {world}."
                )
            mesh = init_device_mesh((dp_degree, pp_degree, mp_degree), ("dp", "pp", "mp"))
        else:
            unknown = set(mesh.mesh_dim_names) - {"dp", "pp", "mp"}
            if unknown:
                raise ValueError(f"HybridCommunicateGroup: mesh dimensions {sorted(unknown)} are "
                                 "not dp, pp or mp.")
        self.mesh = mesh
        _world.current().hybrid_group = self  # the default of Paddle's mp layers

    def _degree(self, dim: str) -> int:
        return self.mesh.size(dim) if dim in self.mesh.mesh_dim_names else 1

    def _rank(self, dim: str) -> int:
        return self.mesh.get_local_rank(dim) if dim in self.mesh.mesh_dim_names else 0

    def _group(self, dim: str) -> ProcessGroup:
        if dim not in self.mesh.mesh_dim_names:
            raise ValueError(f"HybridCommunicateGroup: the mesh has no {dim!r} dimension.")
        return self.mesh.get_group(dim)

    def get_global_rank(self) -> int:
        return self.mesh.get_rank()

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

    def get_stage_id(self) -> int:
        return self._rank("pp")

    def is_first_stage(self) -> bool:
        return self.get_stage_id() == 0

    def is_last_stage(self) -> bool:
        return self.get_stage_id() == self._degree("pp") - 1

    def _pp_neighbour(self, step: int) -> int:
        if "pp" not in self.mesh.mesh_dim_names:
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
        return (f"HybridCommunicateGroup(dp={self._degree('dp')}, pp={self._degree('pp')}, "
                f"mp={self._degree('mp')})")


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
