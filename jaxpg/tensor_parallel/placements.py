"""torch's placements over the tensor-parallel axis: ``Shard(dim)``, ``Replicate()``, ``Partial()``.

A placement says how one logical tensor is laid out over the ranks of the tensor-parallel
group: split along ``dim`` (each rank holds one contiguous chunk, in group-rank order),
identical on every rank, or a per-rank summand of the tensor (a pending sum). In host code
a tensor is one global ``jax.Array`` and its placement is the ``PartitionSpec`` of its
``NamedSharding`` (:func:`layout_spec`); inside SPMD code each rank holds its local part.
``Partial`` exists only inside SPMD code.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import PartitionSpec as P

__all__ = ["Placement", "Shard", "Replicate", "Partial", "layout_spec", "normalize_dim"]


class Placement:
    """Base class of the placements (torch's ``torch.distributed.tensor.Placement``)."""

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


@dataclasses.dataclass(frozen=True)
class Shard(Placement):
    """Split along tensor dimension ``dim`` (negative counts from the end)."""

    dim: int

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"


@dataclasses.dataclass(frozen=True)
class Replicate(Placement):
    """The same full tensor on every rank."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"


@dataclasses.dataclass(frozen=True)
class Partial(Placement):
    """Each rank holds a summand; the tensor is their sum (``reduce_op`` is ``"sum"``)."""

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op != "sum":
            raise ValueError(f"Partial: reduce_op={self.reduce_op!r} is not supported; only "
                             "'sum' partial tensors arise in tensor parallelism.")

    def is_partial(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Partial()"


def check_placement(value: Any, name: str, api: str) -> Placement:
    """Returns ``value`` if it is a Placement, else raises a TypeError naming ``name``."""
    if not isinstance(value, Placement):
        raise TypeError(
            f"{api}: {name}={value!r} must be a placement: Shard(dim), Replicate() or "
            "Partial() (from jaxpg.tensor_parallel)."
        )
    return value


def normalize_dim(dim: int, ndim: int, what: str = "tensor") -> int:
    """``dim`` as a non-negative index into ``ndim`` dimensions; raises if out of range."""
    if not -ndim <= dim < ndim:
        raise ValueError(f"Shard(dim={dim}) is out of range for a {ndim}-dimensional {what}.")
    return dim % ndim


def layout_spec(placement: Placement, ndim: int, axis: str) -> P:
    """The ``PartitionSpec`` of a ``ndim``-dimensional tensor laid out by ``placement``.

    Example:
        >>> layout_spec(Shard(-1), 3, "tp")
        PartitionSpec(None, None, 'tp')
    """
    if placement.is_partial():
        raise ValueError(
            "Partial() describes per-rank summands, which exist only inside SPMD code; a "
            "global array in host code is Shard(dim) or Replicate()."
        )
    if isinstance(placement, Shard):
        d = normalize_dim(placement.dim, ndim)
        return P(*([None] * d + [axis]))
    return P()
