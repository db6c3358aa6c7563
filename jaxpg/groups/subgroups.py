"""new_group, new_subgroups and new_subgroups_by_enumeration, and rank translation."""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence

import jax

from jaxpg.groups import world as _world
from jaxpg.groups.process_group import ProcessGroup
from jaxpg.groups.world import GroupMember

__all__ = [
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "get_group_rank",
    "get_global_rank",
    "get_process_group_ranks",
]


def _check_ranks(ranks: Iterable[int], world_size: int, api: str, arg: str,
                 sort: bool = True) -> tuple[int, ...]:
    ranks = list(ranks)
    for r in ranks:
        if not isinstance(r, int) or isinstance(r, bool):
            raise TypeError(f"{api}: {arg} must hold integer ranks; got {r!r} in {ranks}.")
        if not 0 <= r < world_size:
            raise ValueError(
                f"{api}: rank {r} in {arg}={ranks} is out of range; the world has ranks "
                f"0..{world_size - 1}."
            )
    if len(set(ranks)) != len(ranks):
        dups = sorted({r for r in ranks if ranks.count(r) > 1})
        raise ValueError(f"{api}: {arg}={ranks} lists rank(s) {dups} more than once.")
    if len(ranks) > world_size:
        raise ValueError(
            f"{api}: {arg} has {len(ranks)} ranks but the world has only {world_size}."
        )
    return tuple(sorted(ranks)) if sort else tuple(ranks)


def _register(state: _world.WorldState, groups: Sequence[ProcessGroup]) -> None:
    for g in groups:
        state.groups[g.group_name] = g
    if state.multiprocess:
        from jaxpg.groups import multiprocess

        multiprocess.on_groups_created(state, groups)


def _member_or_sentinel(
    state: _world.WorldState, group: ProcessGroup
) -> ProcessGroup | object:
    if any(r in group.ranks for r in state.local_ranks):
        return group
    state.non_member_ranks = tuple(group.ranks)
    return GroupMember.NON_GROUP_MEMBER


def new_group(
    ranks: Sequence[int] | None = None,
    timeout: datetime.timedelta | None = None,
    backend: str | None = None,
    pg_options: object = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: object = None,
    sort_ranks: bool = True,
) -> ProcessGroup | object:
    """Creates a group of any subset of the world's ranks, with torch 2.13's arguments.

    Every process must call it with the same arguments, as in torch. A process that holds
    none of ``ranks`` gets ``GroupMember.NON_GROUP_MEMBER``.

    Args:
        ranks: global ranks (the world for None).
        timeout: the group's timeout (the world's for None).
        backend: must be the world's backend, or None.
        pg_options: accepted and unused (XLA's collectives have no such options).
        use_local_synchronization: only the group's members need to call (the creation
            barrier runs over their processes, not the world's), as in torch; members must
            create their local-synchronization groups in one order.
        group_desc: a description, kept as ``group.group_desc`` (not the group's name).
        device_id: accepted for torch's signature: jaxpg's groups always run on the ranks'
            own devices, made ready when the world starts.
        sort_ranks: False keeps ``ranks``' order, so that ``ranks[i]`` is group rank ``i``.

    Example:
        >>> g = jaxpg.new_group([0, 3, 5])
        >>> jaxpg.get_process_group_ranks(g)
        [0, 3, 5]
    """
    del pg_options, device_id
    state = _world.current()
    n = len(state.devices)
    if backend is not None and str(backend).lower() != str(state.backend):
        raise ValueError(
            f"new_group: backend={backend!r} differs from the world's {state.backend!r}; "
            "a group uses the world's backend (XLA's collectives)."
        )
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"new_group: timeout must be a datetime.timedelta; got {timeout!r}.")
    checked = tuple(range(n)) if ranks is None else _check_ranks(ranks, n, "new_group", "ranks",
                                                                  sort=sort_ranks)
    if not checked:
        raise ValueError("new_group: ranks=[] is empty; a group needs at least one rank.")
    name = None
    if use_local_synchronization:
        made = state.__dict__.setdefault("_local_sync_groups", {})
        made[checked] = made.get(checked, 0) + 1
        name = f"local{made[checked]}_" + "_".join(map(str, checked))
    group = ProcessGroup(state, checked, timeout=timeout, name=name)
    group.group_desc = group_desc if group_desc is not None else group.group_name
    member = any(r in group.ranks for r in state.local_ranks)
    if use_local_synchronization:
        state.groups[group.group_name] = group
        if member and state.multiprocess:
            from jaxpg.groups import multiprocess

            multiprocess.on_groups_created(state, [group], members_only=True)
    else:
        _register(state, [group])
    return _member_or_sentinel(state, group)


def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: Sequence[Sequence[int]],
    timeout: datetime.timedelta | None = None,
    backend: str | None = None,
    pg_options: object = None,
) -> tuple[ProcessGroup | None, list[ProcessGroup]]:
    """Creates one group per rank list; the lists must not overlap.

    Returns:
        ``(cur_subgroup, subgroups)``: the subgroup holding the acting rank (None if no
        list holds it) and every subgroup. The subgroups form a family: see ProcessGroup.
    """
    del backend, pg_options
    state = _world.current()
    n = len(state.devices)
    api = "new_subgroups_by_enumeration"
    if not ranks_per_subgroup_list:
        raise ValueError(f"{api}: ranks_per_subgroup_list must not be empty.")
    lists = [
        _check_ranks(r, n, api, f"ranks_per_subgroup_list[{i}]")
        for i, r in enumerate(ranks_per_subgroup_list)
    ]
    seen: dict[int, int] = {}
    for i, ranks in enumerate(lists):
        if not ranks:
            raise ValueError(f"{api}: ranks_per_subgroup_list[{i}] is empty.")
        for r in ranks:
            if r in seen:
                raise ValueError(
                    f"{api}: rank {r} appears in ranks_per_subgroup_list[{seen[r]}] and [{i}]; "
                    "subgroups must not overlap."
                )
            seen[r] = i
    family = tuple(lists)
    groups = [ProcessGroup(state, ranks, timeout=timeout, family=family) for ranks in lists]
    _register(state, groups)
    acting = state.acting_rank()
    cur = next((g for g in groups if acting in g.ranks), None)
    return cur, groups


def new_subgroups(
    group_size: int | None = None,
    group: ProcessGroup | None = None,
    timeout: datetime.timedelta | None = None,
    backend: str | None = None,
    pg_options: object = None,
) -> tuple[ProcessGroup | None, list[ProcessGroup]]:
    """Splits ``group`` (the world for None) into subgroups of ``group_size`` consecutive ranks.

    ``group_size`` defaults to the number of devices per process (torch: GPUs per machine).
    """
    state = _world.current()
    parent = _world._resolve_group(group, "new_subgroups")
    if group_size is None:
        group_size = jax.local_device_count()
    if not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"new_subgroups: group_size={group_size!r} must be a positive int.")
    size = parent.size()
    if group_size > size:
        raise ValueError(
            f"new_subgroups: group_size={group_size} is larger than the group's size {size}."
        )
    if size % group_size:
        raise ValueError(
            f"new_subgroups: group_size={group_size} must divide the group's size {size}."
        )
    lists = [parent.ranks[i : i + group_size] for i in range(0, size, group_size)]
    del state
    return new_subgroups_by_enumeration(lists, timeout=timeout, backend=backend,
                                        pg_options=pg_options)


def _non_member_ranks(api: str) -> tuple[int, ...]:
    """The ranks torch answers for ``GroupMember.NON_GROUP_MEMBER``: those of the latest
    group this process was left out of (torch keys them by the sentinel)."""
    ranks = _world.current().non_member_ranks
    if ranks is None:
        raise ValueError(
            f"{api}: group GroupMember.NON_GROUP_MEMBER is not registered: this process has "
            "been left out of no group yet. Pass a group made by new_group."
        )
    return ranks


def get_process_group_ranks(group: ProcessGroup | None) -> list[int]:
    """Returns the global ranks of ``group`` in group-rank order.

    For ``GroupMember.NON_GROUP_MEMBER`` it answers as torch does: the ranks of the latest
    group this process is not a member of.
    """
    if group is GroupMember.NON_GROUP_MEMBER:
        return list(_non_member_ranks("get_process_group_ranks"))
    return list(_world._resolve_group(group, "get_process_group_ranks").ranks)


def get_group_rank(group: ProcessGroup | None, global_rank: int) -> int:
    """Translates a global rank into ``group``'s rank; raises if it is not a member.

    ``GroupMember.NON_GROUP_MEMBER`` stands, as in torch, for the latest group this process
    is not a member of.
    """
    if group is GroupMember.NON_GROUP_MEMBER:
        ranks = _non_member_ranks("get_group_rank")
        if global_rank not in ranks:
            raise ValueError(f"get_group_rank: global_rank={global_rank} is not part of the "
                             f"group (ranks {list(ranks)}).")
        return ranks.index(global_rank)
    pg = _world._resolve_group(group, "get_group_rank")
    r = pg.group_rank(global_rank)
    if r < 0:
        raise ValueError(
            f"get_group_rank: global_rank={global_rank} is not part of group "
            f"{pg.group_name!r} (ranks {list(pg.ranks)})."
        )
    return r


def get_global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    """Translates ``group``'s rank ``group_rank`` into a global rank (for
    ``GroupMember.NON_GROUP_MEMBER``, in the latest group this process is not in, as torch)."""
    if group is GroupMember.NON_GROUP_MEMBER:
        ranks = _non_member_ranks("get_global_rank")
        if not (isinstance(group_rank, int) and 0 <= group_rank < len(ranks)):
            raise ValueError(f"get_global_rank: group_rank={group_rank!r} is not part of the "
                             f"group (ranks {list(ranks)}).")
        return ranks[group_rank]
    return _world._resolve_group(group, "get_global_rank").global_rank(group_rank)
