"""How a data-parallel wrapper splits its batch's sequence dimension over a cp axis.

torch's ``context_parallel(cp_mesh, buffers=..., buffer_seq_dims=...)`` shards each buffer
along its sequence dimension over the cp mesh, load-balanced for causal masks; torchtitan
then averages gradients over ``dp_cp``. ``DistributedDataParallel`` and
``FullyShardedDataParallel`` take ``context_parallel=`` for the same: a cp group (defaults
below) or a :class:`SequenceSplit` to choose the sequence dimension and the layout.
:func:`resolve_sequence_split` turns either into the axis on the topology's mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from jaxpg.groups.mesh_axis import resolve_mesh_axis

__all__ = ["SequenceSplit", "ResolvedSequenceSplit", "resolve_sequence_split"]


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """The batch's sequence dimension split over a context-parallel group.

    Args:
        group: the cp group: ``mesh["cp"]`` of a larger DeviceMesh, its ProcessGroup, or a
            ``ParallelDims`` (its cp axis).
        seq_dim: the sequence dimension of every batch leaf that has one (dim 0 holds the
            samples); a leaf with ``seq_dim`` or fewer dimensions is split over samples only.
        load_balance: the ``2·cp``-chunk layout (rank ``i`` holds chunks ``i`` and
            ``2·cp−1−i``), which :class:`~jaxpg.context_parallel.ContextParallelAttention`
            assumes for ``causal=True`` by default; False: contiguous shards.
    """

    group: Any
    seq_dim: int = 1
    load_balance: bool = True


@dataclasses.dataclass(frozen=True)
class ResolvedSequenceSplit:
    """A :class:`SequenceSplit` on the topology's mesh.

    Attributes:
        mesh: the ``jax.sharding.Mesh`` the cp group is an axis of (the step runs over it).
        axis: the cp axis name on ``mesh``.
        size: the cp degree.
        seq_dim: the batch leaves' sequence dimension.
        load_balance: the ``2·cp``-chunk layout.
    """

    mesh: Mesh
    axis: str
    size: int
    seq_dim: int
    load_balance: bool

    @property
    def chunks(self) -> int:
        """How many equal chunks a sequence is cut into (its length must divide by it)."""
        return 2 * self.size if self.load_balance else self.size


def resolve_sequence_split(context_parallel: Any, api: str) -> ResolvedSequenceSplit:
    """The :class:`ResolvedSequenceSplit` of a wrapper's ``context_parallel=`` argument.

    Raises:
        ValueError: ``seq_dim`` below 1 (dim 0 holds the samples), or a group that is not
            one dimension of a mesh.
        TypeError: ``seq_dim`` not an int, ``load_balance`` not a bool, or anything that is
            not a group.
    """
    split = context_parallel if isinstance(context_parallel, SequenceSplit) \
        else SequenceSplit(context_parallel)
    if isinstance(split.seq_dim, bool) or not isinstance(split.seq_dim, int):
        raise TypeError(f"{api}: context_parallel's seq_dim={split.seq_dim!r} must be an int.")
    if split.seq_dim < 1:
        raise ValueError(
            f"{api}: context_parallel's seq_dim={split.seq_dim} must be 1 or more: dim 0 of "
            "every batch leaf holds the samples, split over the data-parallel axes.")
    if not isinstance(split.load_balance, bool):
        raise TypeError(f"{api}: context_parallel's load_balance={split.load_balance!r} must "
                        "be a bool.")
    cp = resolve_mesh_axis(split.group, "cp", api=api, arg="context_parallel")
    return ResolvedSequenceSplit(cp.mesh, cp.axis, cp.size, split.seq_dim, split.load_balance)
