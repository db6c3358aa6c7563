"""ZeroRedundancyOptimizer's partition (torch's rule) and its argument checks in one
process. Its steps, one rank per process, are checked against Adam on the whole batch in
tests/multiprocess/test_pipeline_stage.py (ZeRO-1 and ZeRO-2 under data-parallel
pipelines)."""

import itertools

import numpy as np
import optax
import pytest

import jaxpg
from jaxpg.ddp import ZeroRedundancyOptimizer
from jaxpg.ddp.zero_optimizer import partition_parameters


def _naive(sizes, n):
    """torch's rule written out: largest first, to the least-loaded rank (lowest on ties)."""
    totals, owner = [0] * n, {}
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = int(np.argmin(totals))  # argmin takes the first of equal totals
        owner[i] = r
        totals[r] += sizes[i]
    return [[i for i in range(len(sizes)) if owner[i] == r] for r in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_partition_is_torchs_greedy_rule(n):
    rng = np.random.default_rng(n)
    for sizes in ([16, 64, 4, 256, 256, 8], rng.integers(1, 1000, 11).tolist(), [5] * 7, [9]):
        owned = partition_parameters(sizes, n)
        assert owned == _naive(sizes, n)
        assert sorted(itertools.chain(*owned)) == list(range(len(sizes)))
    # the largest parameters spread first: 4 equal ones over 4 ranks, one each
    assert partition_parameters([10, 10, 10, 10], 4) == [[0], [1], [2], [3]]


def test_one_rank_per_process_and_an_optax_optimizer(world):
    params = {"w": np.ones((4, 4), np.float32)}
    with pytest.raises(ValueError, match=r"this process holds 8 ranks of .*one rank per "
                                         r"process.*zero_stage=1"):
        ZeroRedundancyOptimizer(optax.adam(1e-3), params)
    with pytest.raises(TypeError, match=r"optax.GradientTransformation"):
        ZeroRedundancyOptimizer("adam", params, group=jaxpg.new_group([0]))
    zero = ZeroRedundancyOptimizer(optax.sgd(0.5), params, group=jaxpg.new_group([0]))
    assert zero.owned == [0]
    with pytest.raises(ValueError, match=r"grads has a leaf of shape \(3,\)"):
        zero.step({"w": np.ones(3, np.float32)}, params)
    new = zero.step({"w": np.full((4, 4), 2.0, np.float32)}, params)
    np.testing.assert_allclose(np.asarray(new["w"]), np.zeros((4, 4)))  # 1 - 0.5 * 2
