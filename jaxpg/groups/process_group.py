"""ProcessGroup: an ordered set of ranks (devices), and the non-member sentinel.

``GroupMember`` (with ``WORLD``, which needs the world's state) lives in ``world.py``.
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np
from jax.sharding import Mesh

__all__ = ["ProcessGroup", "NON_GROUP_MEMBER"]

_group_ids = itertools.count()


class ProcessGroup:
    """An ordered set of global ranks; rank ``i`` of the group is ``ranks[i]``.

    A group is a JAX ``Mesh`` over its ranks' devices with one axis, ``axis_name``.
    Groups made together by ``new_subgroups`` or ``new_subgroups_by_enumeration`` share a
    *family* (``family``): in SPMD code, and in eager calls from a process that holds ranks
    of several of them, each rank takes part in the subgroup of the family that holds it,
    just as each torch process passes its own ``cur_subgroup``. A group made by ``new_group``
    is a family of one.

    Do not construct directly: use ``init_process_group``, ``new_group``,
    ``new_subgroups``, ``new_subgroups_by_enumeration`` or a ``DeviceMesh``. ``world`` is
    the world's state (``jaxpg.groups.world.WorldState``, typed loosely here so that this
    module, below ``world.py``, does not import it).
    """

    def __init__(
        self,
        world: Any,
        ranks: Sequence[int],
        *,
        name: str | None = None,
        timeout: datetime.timedelta | None = None,
        family: tuple[tuple[int, ...], ...] | None = None,
    ):
        self._world = world
        self.id = next(_group_ids)
        self.ranks: tuple[int, ...] = tuple(int(r) for r in ranks)
        self.group_name = name or world.next_group_name()
        self.group_desc: str = self.group_name  # torch's description (new_group's group_desc)
        self.timeout = timeout or world.timeout
        self.family: tuple[tuple[int, ...], ...] = family or (self.ranks,)
        self.axis_name = f"_jaxpg_{self.group_name}"
        self.seq = 0
        self._group_rank = {r: i for i, r in enumerate(self.ranks)}
        self.store: Any = None  # a PrefixStore over the world's store, in multi-process runs
        # (jax Mesh, axis name) when the group is one dimension of a DeviceMesh: the whole
        # mesh, so that arrays sharded over this dimension live on the same Mesh as the rest.
        self.mesh_dim: tuple[Mesh, str] | None = None

    # torch.distributed.ProcessGroup's methods ------------------------------------------------
    def size(self) -> int:
        """Returns the number of ranks in the group."""
        return len(self.ranks)

    def rank(self) -> int:
        """Returns the acting rank's rank in this group, or -1 if it is not a member."""
        return self.group_rank(self._world.acting_rank())

    @property
    def backend(self) -> str:
        """The group's backend name."""
        return str(self._world.backend)

    def name(self) -> str:
        """Returns the group's name."""
        return self.group_name

    # rank arithmetic -------------------------------------------------------------------------
    def group_rank(self, global_rank: int) -> int:
        """Returns ``global_rank``'s rank in this group, or -1 if it is not a member."""
        return self._group_rank.get(int(global_rank), -1)

    def global_rank(self, group_rank: int) -> int:
        """Returns the global rank of this group's rank ``group_rank``."""
        if not 0 <= group_rank < len(self.ranks):
            raise ValueError(
                f"group_rank={group_rank} is out of range for group {self.group_name!r} "
                f"of size {len(self.ranks)}."
            )
        return self.ranks[group_rank]

    @cached_property
    def members(self) -> tuple[int, ...]:
        """Every global rank of the family, sorted: the ranks that run this group's kernels."""
        return tuple(sorted(set(itertools.chain.from_iterable(self.family))))

    @cached_property
    def devices(self) -> list[Any]:
        """The group's devices, in group-rank order."""
        return [self._world.devices[r] for r in self.ranks]

    @cached_property
    def jax_mesh(self) -> Mesh:
        """A one-axis ``jax.sharding.Mesh`` over the group's devices, axis ``axis_name``."""
        return Mesh(np.array(self.devices, dtype=object), (self.axis_name,))

    @property
    def mesh(self) -> Mesh:
        """The same as :attr:`jax_mesh` (kept: the data-parallel internals read it; prefer
        ``jax_mesh``, the name every mesh-holding type shares)."""
        return self.jax_mesh

    @cached_property
    def family_mesh(self) -> Mesh:
        """A one-axis Mesh over every device of the family: where eager kernels run."""
        devices = [self._world.devices[r] for r in self.members]
        return Mesh(np.array(devices, dtype=object), (self.axis_name,))

    def local_members(self) -> list[int]:
        """The family's global ranks that live in this process, in rank order."""
        local = set(self._world.local_ranks)
        return [r for r in self.members if r in local]

    def next_seq(self) -> int:
        """Returns the sequence number of the group's next eager collective."""
        self.seq += 1
        return self.seq

    def __repr__(self) -> str:
        family = "" if len(self.family) == 1 else f", family of {len(self.family)}"
        return f"ProcessGroup({self.group_name!r}, ranks={list(self.ranks)}{family})"


class _NonGroupMember:
    """Returned by group constructors to a process that holds no rank of the group."""

    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"

    def size(self) -> int:
        raise ValueError(
            "This process is not a member of the group (GroupMember.NON_GROUP_MEMBER), "
            "so the group has no size here; check `group is not GroupMember.NON_GROUP_MEMBER`."
        )

    def rank(self) -> int:
        return -1


NON_GROUP_MEMBER = _NonGroupMember()
