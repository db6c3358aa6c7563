"""World and groups: init_process_group, new_group, ParallelDims, DeviceMesh,
HybridCommunicateGroup."""

from jaxpg.groups.backend import Backend
from jaxpg.groups.device_mesh import DeviceMesh, init_device_mesh
from jaxpg.groups.hybrid import HybridCommunicateGroup, get_hybrid_communicate_group
from jaxpg.groups.parallel_dims import ParallelDims
from jaxpg.groups.process_group import ProcessGroup
from jaxpg.groups.subgroups import (
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
)
from jaxpg.groups.world import (
    GroupMember,
    as_rank,
    default_pg_timeout,
    destroy_process_group,
    get_backend,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
)

__all__ = [
    "Backend", "DeviceMesh", "init_device_mesh", "HybridCommunicateGroup",
    "get_hybrid_communicate_group", "GroupMember", "ProcessGroup", "get_global_rank",
    "get_group_rank", "get_process_group_ranks", "new_group",
    "new_subgroups", "new_subgroups_by_enumeration", "as_rank", "default_pg_timeout",
    "destroy_process_group", "get_backend", "get_rank", "get_world_size", "init_process_group",
    "is_initialized", "ParallelDims",
]
