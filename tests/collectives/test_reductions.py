"""all_reduce, reduce, reduce_scatter(_tensor): every op x dtype x group kind, both lowerings."""

import numpy as np
import pytest
from _reference import (
    DTYPES,
    GROUP_KINDS,
    UNEVEN_KINDS,
    all_ops,
    assert_close,
    assert_non_members_keep_input,
    make_group,
    np_reduce,
    per_rank,
    rank_data,
    valid,
)

import jaxpg
from jaxpg import ReduceOp

CASES = [(op, dt) for op in all_ops() for dt in DTYPES if valid(op, dt)]


@pytest.mark.parametrize("lowering", ["eager", "spmd"])
@pytest.mark.parametrize("kind", GROUP_KINDS)
@pytest.mark.parametrize("op,dtype", CASES, ids=[f"{o}-{d}" for o, d in CASES])
def test_all_reduce(op, dtype, kind, lowering):
    group, family = make_group(kind)
    x = rank_data((3,), dtype)
    got = per_rank(lowering, lambda v: jaxpg.all_reduce(v, op=op, group=group), x, family)
    for sub in family:
        want = np_reduce(op, [x[r] for r in sub])
        for r in sub:
            assert_close(got[r], want, dtype)
    if lowering == "spmd":  # non-members get their input back
        assert_non_members_keep_input(got, x, family, dtype)


UNEVEN_CASES = [(op, dt) for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX,
                                    ReduceOp.AVG) for dt in ("float32", "int32") if valid(op, dt)]


@pytest.mark.parametrize("lowering", ["eager", "spmd"])
@pytest.mark.parametrize("op,dtype", UNEVEN_CASES, ids=[f"{o}-{d}" for o, d in UNEVEN_CASES])
def test_all_reduce_over_uneven_subgroups(op, dtype, lowering):
    """Subgroups of 3 and 5 ranks, each rank's data its own: each subgroup's result is its
    own (AVG divides by 3 or 5, not by the larger size; MIN, MAX and PRODUCT see only their
    subgroup's ranks)."""
    group, family = make_group("uneven")
    assert [len(sub) for sub in family] == [3, 5]
    x = rank_data((3,), dtype, seed=5)
    got = per_rank(lowering, lambda v: jaxpg.all_reduce(v, op=op, group=group), x, family)
    wants = [np_reduce(op, [x[r] for r in sub]) for sub in family]
    assert not np.array_equal(wants[0], wants[1])  # the subgroups' results differ
    for sub, want in zip(family, wants, strict=True):
        for r in sub:
            assert_close(got[r], want, dtype)


@pytest.mark.parametrize("lowering", ["eager", "spmd"])
@pytest.mark.parametrize("kind", UNEVEN_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_to_dst(dtype, kind, lowering):
    group, family = make_group(kind)
    op = jaxpg.ReduceOp.MAX
    x = rank_data((2,), dtype, seed=1)
    dst = jaxpg.get_global_rank(group, 1)
    got = per_rank(lowering, lambda v: jaxpg.reduce(v, dst=dst, op=op, group=group), x, family)
    for sub in family:
        want = np_reduce(op, [x[r] for r in sub])
        for j, r in enumerate(sub):
            assert_close(got[r], want if j == 1 else x[r], dtype)


@pytest.mark.parametrize("lowering", ["eager", "spmd"])
@pytest.mark.parametrize("kind", GROUP_KINDS)
@pytest.mark.parametrize("op", [jaxpg.ReduceOp.SUM, jaxpg.ReduceOp.AVG, jaxpg.ReduceOp.MIN],
                         ids=str)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reduce_scatter_tensor(op, kind, lowering, dtype):
    group, family = make_group(kind)
    k = len(family[0])
    x = rank_data((k * 2, 3), dtype, seed=2)
    got = per_rank(lowering, lambda v: jaxpg.reduce_scatter_tensor(v, op=op, group=group), x,
               family)
    for sub in family:
        full = np_reduce(op, [x[r] for r in sub])
        for j, r in enumerate(sub):
            assert_close(got[r], full[2 * j: 2 * j + 2], dtype)


@pytest.mark.parametrize("lowering", ["eager", "spmd"])
@pytest.mark.parametrize("kind", GROUP_KINDS)
@pytest.mark.parametrize("dtype", ["int32", "bool"])
def test_reduce_scatter_list(kind, lowering, dtype):
    group, family = make_group(kind)
    k = len(family[0])
    op = jaxpg.ReduceOp.BOR if dtype == "bool" else jaxpg.ReduceOp.SUM
    x = rank_data((k, 4), dtype, seed=3)
    fn = lambda v: jaxpg.reduce_scatter([v[i] for i in range(k)] if lowering == "spmd"
                                        else [v[:, i] for i in range(k)], op=op, group=group)
    got = per_rank(lowering, fn, x, family)
    for sub in family:
        full = np_reduce(op, [x[r] for r in sub])
        for j, r in enumerate(sub):
            assert_close(got[r], full[j], dtype)


def test_reduce_scatter_single_is_tensor_form():
    assert jaxpg.reduce_scatter_single is jaxpg.reduce_scatter_tensor
    assert jaxpg.all_gather_single is jaxpg.all_gather_into_tensor


@pytest.mark.parametrize("lowering", ["eager", "spmd"])
def test_all_reduce_async_work(lowering):
    x = rank_data((4,), "float32")
    if lowering == "eager":
        work = jaxpg.all_reduce(x, async_op=True)
        assert isinstance(work, jaxpg.Work)
        assert work.wait(timeout=60)
        assert work.is_completed() and work.is_success() and work.exception() is None
        np.testing.assert_allclose(np.asarray(work.result())[0], x.sum(0), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(work.get_future().result(timeout=60))[3],
                                   x.sum(0), rtol=1e-6)
    else:
        out = jaxpg.spmd(lambda v: jaxpg.all_reduce(v, async_op=True).result())(x)
        np.testing.assert_allclose(np.asarray(out)[5], x.sum(0), rtol=1e-6)
