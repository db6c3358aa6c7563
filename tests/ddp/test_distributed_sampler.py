"""DistributedSampler: torch's index sets (shuffle=False) and structure (shuffle=True)."""

import math

import numpy as np
import pytest
from _require import import_or_skip

from jaxpg.ddp import DistributedSampler


def torch_indices(n, num_replicas, rank, drop_last, permutation=None):
    """torch.utils.data.DistributedSampler.__iter__, transcribed; `permutation` replaces
    torch.randperm when shuffling."""
    if drop_last and n % num_replicas != 0:
        num_samples = math.ceil((n - num_replicas) / num_replicas)
    else:
        num_samples = math.ceil(n / num_replicas)
    total_size = num_samples * num_replicas
    indices = list(permutation) if permutation is not None else list(range(n))
    if not drop_last:
        padding_size = total_size - len(indices)
        if padding_size <= len(indices):
            indices += indices[:padding_size]
        else:
            indices += (indices * math.ceil(padding_size / len(indices)))[:padding_size]
    else:
        indices = indices[:total_size]
    assert len(indices) == total_size
    indices = indices[rank:total_size:num_replicas]
    assert len(indices) == num_samples
    return indices


CASES = [(n, r) for n in (0, 1, 3, 7, 8, 10, 16, 17, 100) for r in (1, 2, 3, 4, 8)]


def test_no_shuffle_equals_torchs_own_sampler():
    """torch.utils.data.distributed.DistributedSampler itself, not the transcription above."""
    import_or_skip("torch", "torch's DistributedSampler is the reference")
    from torch.utils.data.distributed import DistributedSampler as TorchSampler

    for n, num_replicas in CASES:
        for drop_last in (False, True):
            for rank in range(num_replicas):
                theirs = TorchSampler(range(n), num_replicas=num_replicas, rank=rank,
                                      shuffle=False, drop_last=drop_last)
                ours = DistributedSampler(n, num_replicas=num_replicas, rank=rank,
                                          shuffle=False, drop_last=drop_last)
                assert list(ours) == list(theirs), (n, num_replicas, rank, drop_last)
                assert len(ours) == len(theirs)
                if n:  # with shuffling: the same sizes and padding, another permutation
                    shuffled = TorchSampler(range(n), num_replicas=num_replicas, rank=rank,
                                            shuffle=True, seed=3, drop_last=drop_last)
                    assert len(DistributedSampler(n, num_replicas=num_replicas, rank=rank,
                                                  seed=3, drop_last=drop_last)) == len(shuffled)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("n, num_replicas", CASES)
def test_no_shuffle_equals_torch(n, num_replicas, drop_last):
    for rank in range(num_replicas):
        sampler = DistributedSampler(n, num_replicas, rank, shuffle=False, drop_last=drop_last)
        expected = torch_indices(n, num_replicas, rank, drop_last)
        assert list(sampler) == expected
        assert len(sampler) == len(expected)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("n, num_replicas", [(10, 4), (3, 8), (17, 3), (64, 8)])
def test_shuffle_has_torch_structure(n, num_replicas, drop_last):
    seed, epoch = 3, 2
    perm = np.random.default_rng(seed + epoch).permutation(n).tolist()
    per_rank = []
    for rank in range(num_replicas):
        sampler = DistributedSampler(n, num_replicas, rank, seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch)
        got = list(sampler)
        assert got == torch_indices(n, num_replicas, rank, drop_last, perm)
        assert len(got) == len(sampler)
        per_rank.append(got)
    flat = [i for part in per_rank for i in part]
    if drop_last:
        assert len(set(flat)) == len(flat)  # ranks are disjoint
    else:
        assert set(flat) == set(range(n))  # every sample is seen


def test_shuffle_is_deterministic_and_changes_with_epoch():
    a = DistributedSampler(100, 4, 1, seed=7)
    b = DistributedSampler(list(range(100)), 4, 1, seed=7)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    epoch1 = [DistributedSampler(100, 4, r, seed=7) for r in range(4)]
    for sampler in epoch1:
        sampler.set_epoch(1)
    assert list(epoch1[1]) == list(a)
    assert sorted(i for sampler in epoch1 for i in sampler) == list(range(100))
    assert list(DistributedSampler(100, 4, 1, seed=8)) != first
    assert list(DistributedSampler(100, 4, 1, shuffle=False)) == list(range(1, 100, 4))


def test_padding_repeats_several_times():
    # 3 samples on 8 ranks: padded to 8 as [0, 1, 2, 0, 1, 2, 0, 1].
    got = [list(DistributedSampler(3, 8, r, shuffle=False)) for r in range(8)]
    assert got == [[0], [1], [2], [0], [1], [2], [0], [1]]
    assert [len(DistributedSampler(3, 8, r, drop_last=True)) for r in range(8)] == [0] * 8


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"num_replicas": 4, "rank": 4}, ValueError, r"Invalid rank 4.*\[0, 3\]"),
        ({"num_replicas": 4, "rank": -1}, ValueError, "Invalid rank -1"),
        ({"num_replicas": 0, "rank": 0}, ValueError, "num_replicas=0"),
        ({"num_replicas": 2.0, "rank": 0}, TypeError, "num_replicas=2.0"),
        ({"num_replicas": 2, "rank": "0"}, TypeError, "rank='0'"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        DistributedSampler(10, **kwargs)


def test_bad_dataset():
    with pytest.raises(TypeError, match="dataset_len_or_dataset"):
        DistributedSampler(object(), 2, 0)
    with pytest.raises(ValueError, match="-1"):
        DistributedSampler(-1, 2, 0)
    with pytest.raises(TypeError, match="epoch"):
        DistributedSampler(10, 2, 0).set_epoch(1.5)
