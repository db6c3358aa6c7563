"""A data sampler that gives each rank its share of a dataset, like torch's.

:class:`DistributedSampler` reproduces the structure of
``torch.utils.data.distributed.DistributedSampler`` exactly:

- ``num_samples = ceil(len / num_replicas)``, or with ``drop_last`` and a length
  that does not divide, ``ceil((len - num_replicas) / num_replicas)``;
  ``total_size = num_samples * num_replicas``.
- Without ``drop_last`` the index list is padded to ``total_size`` by repeating
  it from the start (several times over if the dataset is shorter than the
  padding); with ``drop_last`` its tail is cut to ``total_size``.
- Rank ``r`` takes ``indices[r:total_size:num_replicas]``.

With ``shuffle=False`` the index sets are identical to torch's. With
``shuffle=True`` the list is first permuted, seeded by ``seed + epoch`` so every
rank draws the same permutation; torch draws it with ``torch.randperm`` and
jaxpg with ``numpy.random.default_rng(seed + epoch).permutation``, so the
*order* differs from torch's while every structural property (disjoint ranks,
equal shares, padding, new order per epoch via :meth:`set_epoch`) is the same.
jaxpg does not depend on torch.

``num_replicas`` and ``rank`` default, as in torch, to the default process group: the
number of processes in it and this process's index. With one rank per process (torch's
layout, ``jaxpg-run``) that is ``get_world_size()`` and ``get_rank()``. A process that holds
several ranks (a notebook with 8 devices) gets one share for all of them, which
``DistributedDataParallel.train_step`` splits among its ranks.

Example:
    >>> sampler = DistributedSampler(10, num_replicas=4, rank=1, shuffle=False)
    >>> list(sampler)
    [1, 5, 9]
    >>> len(sampler)
    3
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np


def _dataset_len(dataset: Any) -> int:
    if isinstance(dataset, bool):
        raise TypeError(f"dataset_len_or_dataset={dataset!r} must be an int or have a len().")
    if isinstance(dataset, int | np.integer):
        n = int(dataset)
    elif hasattr(dataset, "__len__"):
        n = len(dataset)
    else:
        raise TypeError(
            f"dataset_len_or_dataset of type {type(dataset).__name__} has no len(); pass the "
            "dataset's length as an int or an object with __len__."
        )
    if n < 0:
        raise ValueError(f"The dataset length {n} must be >= 0.")
    return n


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name}={value!r} must be an int.")
    return int(value)


def _default_group_share() -> tuple[int, int]:
    """(number of processes, this process's index) in the default group, as torch's sampler
    takes ``get_world_size()`` and ``get_rank()``."""
    from jaxpg.groups import world

    state = world.current(required=False)
    if state is None:
        raise ValueError(
            "DistributedSampler: num_replicas and rank default to the default process group, "
            "which is not initialized; call jaxpg.init_process_group() first, or pass "
            "num_replicas= and rank=.")
    return state.process_count, state.process_index


class DistributedSampler:
    """Restricts data loading to this rank's share of the dataset.

    Args:
        dataset_len_or_dataset: the dataset, or its length.
        num_replicas: the number of ranks sharing the dataset; None for the default
            group's (its number of processes: its world size with one rank per process).
        rank: this rank, in ``[0, num_replicas - 1]``; None for this process's index in
            the default group (its rank with one rank per process).
        shuffle: permute the indices every epoch (seeded by ``seed + epoch``).
        seed: the shuffle seed; must be the same on every rank.
        drop_last: drop the tail so that the length divides evenly, instead of
            padding by repeating indices.

    Raises:
        ValueError: if ``num_replicas < 1`` or ``rank`` is out of range, or one of them is
            None before ``init_process_group``.
        TypeError: if an argument has the wrong type.
    """

    def __init__(
        self,
        dataset_len_or_dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None or rank is None:
            replicas, index = _default_group_share()
            num_replicas = replicas if num_replicas is None else num_replicas
            rank = index if rank is None else rank
        num_replicas = _check_int("num_replicas", num_replicas)
        rank = _check_int("rank", rank)
        if num_replicas < 1:
            raise ValueError(f"{num_replicas=} must be at least 1.")
        if rank < 0 or rank >= num_replicas:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]."
            )
        self.dataset = dataset_len_or_dataset
        self.dataset_len = _dataset_len(dataset_len_or_dataset)
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.shuffle = bool(shuffle)
        self.seed = _check_int("seed", seed)
        self.drop_last = bool(drop_last)
        if self.drop_last and self.dataset_len % num_replicas != 0:
            self.num_samples = math.ceil((self.dataset_len - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(self.dataset_len / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def indices(self) -> list[int]:
        """This rank's indices for the current epoch."""
        n = self.dataset_len
        if self.shuffle:
            rng = np.random.default_rng((self.seed + self.epoch) % (1 << 64))
            indices = rng.permutation(n).tolist()
        else:
            indices = list(range(n))
        if not self.drop_last:
            padding = self.total_size - len(indices)
            if padding <= len(indices):
                indices += indices[:padding]
            else:
                indices += (indices * math.ceil(padding / len(indices)))[:padding]
        else:
            indices = indices[: self.total_size]
        return indices[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch, so that ``shuffle=True`` gives a new order each epoch."""
        self.epoch = _check_int("epoch", epoch)

    def __repr__(self) -> str:
        return (
            f"DistributedSampler(len={self.dataset_len}, num_replicas={self.num_replicas}, "
            f"rank={self.rank}, shuffle={self.shuffle}, seed={self.seed}, "
            f"drop_last={self.drop_last}, epoch={self.epoch})"
        )
