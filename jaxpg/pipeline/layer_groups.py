"""The groups of Paddle's ``PipelineLayer``: its pipeline, and the data parallelism around it.

Paddle's ``PipelineLayer`` lives in the topology of ``fleet.init``'s hybrid communicate
group: the pipeline is its ``pp`` group, and the processes at the same pipeline and model
position in other ``dp`` (and ``sharding``) coordinates are replicas of this stage that
train on other samples, whose gradients are averaged. :func:`layer_groups` finds the same
from a :class:`~jaxpg.HybridCommunicateGroup` (the one passed, or the world's latest) and
refuses the layouts a ``PipelineLayer`` would not train as one device would.
"""

from __future__ import annotations

from typing import Any

from jaxpg.groups import world
from jaxpg.groups.hybrid import HybridCommunicateGroup
from jaxpg.groups.process_group import ProcessGroup

__all__ = ["layer_groups"]


def _world_size() -> int:
    state = world.current(required=False)
    return 0 if state is None else state.world_group.size()


def layer_groups(group: Any, hcg: Any, resolve: Any) -> tuple[ProcessGroup, ProcessGroup | None]:
    """``(pipeline group, data-parallel group or None)`` of a ``PipelineLayer``.

    Args:
        group: ``PipelineLayer``'s ``group=`` (None: the hybrid group's ``pp`` group, or
            the world).
        hcg: ``PipelineLayer``'s ``hcg=`` (None: the world's latest HybridCommunicateGroup,
            if one was made).
        resolve: turns ``group`` into a ProcessGroup (``pipeline_stage._pipeline_group``).

    Raises:
        ValueError: the hybrid group has a sequence- or expert-parallel degree, ``group``
            is not its pipeline group, or, without one, the pipeline group does not hold
            every process of the world (the others would train apart, silently).
    """
    if hcg is None:
        state = world.current(required=False)
        hcg = None if state is None else state.hybrid_group
    elif not isinstance(hcg, HybridCommunicateGroup):
        raise TypeError(f"PipelineLayer hcg= must be a HybridCommunicateGroup, got "
                        f"{type(hcg).__name__}.")
    if hcg is None:
        pg = resolve(group)
        if pg.size() != _world_size():
            raise ValueError(
                f"PipelineLayer: the pipeline group {pg!r} holds {pg.size()} of the world's "
                f"{_world_size()} processes, and no HybridCommunicateGroup says what the "
                "others are: as data-parallel replicas they would each train on their own "
                "samples, never averaged. Make the layout first, as Paddle's fleet.init does "
                "(e.g. jaxpg.HybridCommunicateGroup(dp_degree=2, pp_degree=2)), and leave "
                "group=None.")
        return pg, None
    for name, degree in (("sep_degree", hcg.sep_degree),
                         ("ep_degree", hcg.parallel_dims.ep if hcg.parallel_dims else 1)):
        if degree > 1:
            raise ValueError(
                f"PipelineLayer cannot train under {hcg!r} with {name}={degree}: its stages "
                "run no sequence or expert parallelism, so those ranks' gradients would be "
                "averaged as if they were data-parallel replicas. Use a layout of dp, "
                "sharding, pp and mp degrees only.")
    if "pp" not in hcg.device_mesh.mesh_dim_names:
        raise ValueError(f"PipelineLayer: {hcg!r} has no pp dimension; make it with "
                         "pp_degree=num_stages.")
    pipe = hcg.get_pipe_parallel_group()
    if group is not None and tuple(resolve(group).ranks) != tuple(pipe.ranks):
        raise ValueError(
            f"PipelineLayer group={group!r} is not the pipeline group {pipe!r} of {hcg!r}; "
            "leave group=None (PipelineLayer takes the hybrid group's, as Paddle's does) "
            "or pass hcg.get_pipe_parallel_group().")
    dp, sharding = hcg.get_data_parallel_world_size(), hcg.get_sharding_parallel_world_size()
    if dp > 1 and sharding > 1:
        try:
            return pipe, hcg.device_mesh.get_group("dp_sharding")
        except ValueError as err:
            raise ValueError(
                f"PipelineLayer: {hcg!r} has dp and sharding degrees but no flattened "
                "dp x sharding group; make it from its degrees (HybridCommunicateGroup("
                "dp_degree=..., sharding_degree=..., pp_degree=...)).") from err
    if dp > 1:
        return pipe, hcg.get_data_parallel_group()
    if sharding > 1:
        return pipe, hcg.get_sharding_parallel_group()
    return pipe, None
