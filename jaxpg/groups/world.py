"""The default group: init_process_group, destroy_process_group, ranks and sizes.

A rank is a device. Global ranks number every device of every process, process by process
(``jax.devices()`` sorted by process index, then device id), so with one device per process
the global rank is the process index, exactly torch's model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import os
import threading
from collections.abc import Iterator
from typing import Any

import jax

from jaxpg.groups import callbacks
from jaxpg.groups.backend import Backend, resolve_backend
from jaxpg.groups.process_group import NON_GROUP_MEMBER, ProcessGroup
from jaxpg.supervision import world_link

__all__ = [
    "init_process_group",
    "destroy_process_group",
    "is_initialized",
    "get_rank",
    "get_world_size",
    "get_backend",
    "as_rank",
    "default_pg_timeout",
    "GroupMember",
]

#: The default timeout of a process group (30 minutes), as torch's ``default_pg_timeout``.
default_pg_timeout = datetime.timedelta(minutes=30)

_NOT_INITIALIZED = (
    "Default process group has not been initialized, please make sure to call "
    "init_process_group."
)


@dataclasses.dataclass
class WorldState:
    """Everything ``init_process_group`` sets up; one per process."""

    backend: Backend
    devices: list[Any]
    local_ranks: list[int]
    timeout: datetime.timedelta
    store: Any = None
    multiprocess: bool = False
    owns_jax_distributed: bool = False
    world_group: ProcessGroup = dataclasses.field(init=False)
    groups: dict[str, ProcessGroup] = dataclasses.field(default_factory=dict)
    group_count: int = 0
    process_index: int = 0
    process_count: int = 1
    hybrid_group: Any = None  # the latest HybridCommunicateGroup, as Paddle's fleet keeps it
    # the ranks of the latest group this process is not in: what torch answers for
    # GroupMember.NON_GROUP_MEMBER (its sentinel's entry is overwritten by each such group)
    non_member_ranks: tuple[int, ...] | None = None
    _acting: threading.local = dataclasses.field(default_factory=threading.local)

    def __post_init__(self) -> None:
        self.world_group = ProcessGroup(self, range(len(self.devices)), name="WORLD")
        self.groups["WORLD"] = self.world_group

    def next_group_name(self, prefix: str = "group") -> str:
        """A name every process gives the same group, if all create groups in one order."""
        self.group_count += 1
        return f"{prefix}{self.group_count}"

    def acting_rank(self) -> int:
        """The global rank host code acts as: this process's first rank, or ``as_rank``'s."""
        return getattr(self._acting, "rank", self.local_ranks[0])

    def rank_of_device(self, device: Any) -> int:
        return self._rank_by_device_id[device.id]

    @functools.cached_property
    def _rank_by_device_id(self) -> dict[int, int]:
        return {d.id: i for i, d in enumerate(self.devices)}


_state: WorldState | None = None


class _GroupMemberMeta(type):
    @property
    def WORLD(cls) -> ProcessGroup | None:  # noqa: N802 (torch's name)
        return None if _state is None else _state.world_group


class GroupMember(metaclass=_GroupMemberMeta):
    """torch's sentinels: ``GroupMember.WORLD`` (the default group, None before init) and
    ``GroupMember.NON_GROUP_MEMBER``."""

    NON_GROUP_MEMBER = NON_GROUP_MEMBER


def current(required: bool = True) -> WorldState | None:
    """Returns the world state, raising torch's error if ``init_process_group`` wasn't called."""
    if _state is None and required:
        raise ValueError(_NOT_INITIALIZED)
    return _state


world_link.register(current, ProcessGroup)  # supervision finds the world through it


def _ordered_devices() -> list[Any]:
    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def _wants_multiprocess(init_method: str | None, store: Any, world_size: int) -> bool:
    """Whether the world spans processes: arguments say so, or a launcher started several
    (torchrun/jaxpg-run, a Slurm step, mpirun: never silently a world of one)."""
    if (init_method is not None or store is not None or world_size > 1
            or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        return True
    from jaxpg.rendezvous.cluster_env import detect_launcher

    found = detect_launcher()
    return found is not None and found.world_size > 1


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: datetime.timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
) -> None:
    """Initialises the default process group (the world), as ``torch.distributed``.

    With no launcher environment, no ``init_method`` and no ``store``, the world is this
    process's devices: ``jax.devices()``, rank = device. Under a launcher that started
    several processes (``jaxpg-run``/torchrun's ``RANK``/``WORLD_SIZE``, a Slurm step started
    by ``srun``, Open MPI's or MPICH's ``mpirun``; see ``jaxpg.rendezvous.cluster_env``), or
    with ``init_method``/``store``, processes rendezvous through JAX's coordination service
    and the world is every device of every process.

    Args:
        backend: "gloo", "mpi", "nccl", "xla" or None (pick by platform). "mpi" uses XLA's
            MPI collectives under ``mpirun`` (``MPITRAMPOLINE_LIB``; see docs/cluster.md).
        init_method: "env://", "tcp://host:port" or "file:///path"; exclusive with ``store``.
        timeout: the default timeout of every blocking call on the world (30 minutes).
        world_size: number of processes (multi-process only).
        rank: this process's rank (multi-process only).
        store: an existing Store to rendezvous through; exclusive with ``init_method``.
        group_name: accepted for torch compatibility; the world is always "WORLD".
        pg_options: accepted for torch compatibility; unused.
        device_id: accepted for torch compatibility; each process uses its own devices.

    Example:
        >>> import jaxpg
        >>> jaxpg.init_process_group()
        >>> jaxpg.get_world_size() == len(jax.devices())
        True
    """
    global _state
    del group_name, pg_options, device_id
    if _state is not None:
        raise ValueError(
            "trying to initialize the default process group twice! Call "
            "jaxpg.destroy_process_group() first to start again."
        )
    if store is not None and init_method is not None:
        raise ValueError(
            f"Cannot specify both init_method={init_method!r} and store={store!r}; "
            "they are mutually exclusive, as in torch.distributed."
        )
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta; got {timeout!r}.")
    timeout = timeout or default_pg_timeout
    if _wants_multiprocess(init_method, store, world_size):
        from jaxpg.groups import multiprocess

        _state = multiprocess.init_world(
            backend, init_method, timeout, world_size, rank, store, WorldState
        )
        return
    if world_size not in (-1, 1) or rank not in (-1, 0):
        raise ValueError(
            f"world_size={world_size} and rank={rank} describe a multi-process run, but no "
            "init_method or store was given; pass init_method='env://' (under jaxpg-run) "
            "or 'tcp://host:port'."
        )
    chosen = resolve_backend(backend)
    devices = _ordered_devices()
    _state = WorldState(
        backend=chosen,
        devices=devices,
        local_ranks=list(range(len(devices))),
        timeout=timeout,
    )


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Destroys ``group``, or with None every group and the world (then init may run again)."""
    global _state
    state = current()
    if group is None or group is state.world_group:
        callbacks.run_resets()  # upper layers forget their caches (eager kernels)
        if state.multiprocess:
            from jaxpg.groups import multiprocess

            multiprocess.shutdown_world(state)
        _state = None
        return
    if group is GroupMember.NON_GROUP_MEMBER:
        return
    state.groups.pop(group.group_name, None)


def is_initialized() -> bool:
    """Returns True once ``init_process_group`` has run (and not been destroyed)."""
    return _state is not None


GROUP_FORMS = "a ProcessGroup, a 1-D DeviceMesh (mesh['dp']) or None (the world)"
"""What an argument naming one axis (``group=``) accepts."""


def devices_error(api: str, arg: str, value: Any, forms: str) -> TypeError:
    """The one error for an argument naming devices that is none of ``forms``."""
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return TypeError(f"{api}: {arg}= takes {forms}; got {type(value).__name__} {shown}.")


def _resolve_group(group: Any, api: str, arg: str = "group") -> ProcessGroup:
    """The ``ProcessGroup`` that ``group`` names: itself, a 1-D DeviceMesh's group (any
    value whose type has ``_as_process_group(api, arg)``), or the world for None.

    Public as ``jaxpg.groups.resolve.resolve_group``.
    """
    state = current()
    if group is None:
        return state.world_group
    if group is GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{api}: this process is not a member of the group "
            "(GroupMember.NON_GROUP_MEMBER); only members may call it."
        )
    as_group = getattr(type(group), "_as_process_group", None)  # DeviceMesh, above this module
    if as_group is not None:
        group = as_group(group, api, arg)
    if not isinstance(group, ProcessGroup):
        raise devices_error(api, arg, group, GROUP_FORMS)
    if group._world is not state:
        raise ValueError(
            f"{api}: group {group.group_name!r} belongs to a destroyed world; create it again "
            "after init_process_group."
        )
    return group


def get_rank(group: ProcessGroup | None = None) -> Any:
    """Returns the rank in ``group`` (global rank for None); -1 for a non-member.

    Inside ``jaxpg.spmd`` code this is a traced integer: each rank sees its own. In host
    code it is the acting rank: this process's first rank, or the one ``as_rank`` names.
    """
    if group is GroupMember.NON_GROUP_MEMBER:
        current()
        return -1
    pg = _resolve_group(group, "get_rank")
    traced = callbacks.traced_rank(pg)  # set by jaxpg.spmd: the rank inside SPMD code
    if traced is not None:
        return traced
    return pg.group_rank(pg._world.acting_rank())


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Returns the number of ranks in ``group`` (the world for None); -1 for a non-member."""
    if group is GroupMember.NON_GROUP_MEMBER:
        current()
        return -1
    return _resolve_group(group, "get_world_size").size()


def get_backend(group: ProcessGroup | None = None) -> str:
    """Returns the backend name of ``group`` (the world's for None)."""
    return _resolve_group(group, "get_backend").backend


@contextlib.contextmanager
def as_rank(rank: int) -> Iterator[None]:
    """Acts as global rank ``rank`` (one of this process's) in host code within the block.

    With several ranks in one process (a notebook with 8 devices), host code acts as the
    process's first rank by default; ``get_rank()``, ``send``/``recv`` and the ``src``/``dst``
    perspective of point-to-point calls follow this rank instead.

    Example:
        >>> with jaxpg.as_rank(3):
        ...     jaxpg.send(x, dst=5)
    """
    state = current()
    if rank not in state.local_ranks:
        raise ValueError(
            f"as_rank: rank={rank} is not one of this process's ranks {state.local_ranks}."
        )
    previous = getattr(state._acting, "rank", None)
    state._acting.rank = rank
    try:
        yield
    finally:
        if previous is None:
            del state._acting.rank
        else:
            state._acting.rank = previous
