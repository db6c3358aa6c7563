"""all_gather, all_gather_into_tensor, broadcast, gather, scatter, all_to_all(_single):
every dtype x group kind, both lowerings, against numpy."""

import jax
import numpy as np
import pytest
from _reference import (
    DTYPES,
    GROUP_KINDS,
    assert_close,
    assert_non_members_keep_input,
    make_group,
    members,
    per_rank,
    rank_data,
)

import jaxpg


@pytest.mark.parametrize("lowering", ["eager", "spmd"])
@pytest.mark.parametrize("kind", GROUP_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather(dtype, kind, lowering):
    group, family = make_group(kind)
    x = rank_data((2, 3), dtype)
    if lowering == "eager":
        got = jax.device_get(jaxpg.all_gather(x[members(family)], group=group))
        mem = members(family)
        per_rank = {r: [np.asarray(g)[i] for g in got] for i, r in enumerate(mem)}
    else:
        got = jax.device_get(jax.jit(jaxpg.spmd(lambda v: jaxpg.all_gather(v, group=group)))(x))
        per_rank = {r: [np.asarray(g)[r] for g in got] for r in range(8)}
    for sub in family:
        for r in sub:
            assert len(per_rank[r]) == len(sub)
            for j, s in enumerate(sub):
                assert_close(per_rank[r][j], x[s], dtype)


@pytest.mark.parametrize("lowering", ["eager", "spmd"])
@pytest.mark.parametrize("kind", GROUP_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather_into_tensor(dtype, kind, lowering):
    group, family = make_group(kind)
    x = rank_data((2, 3), dtype, seed=4)
    got = per_rank(lowering, lambda v: jaxpg.all_gather_into_tensor(v, group=group), x, family)
    for sub in family:
        for r in sub:
            assert_close(got[r], np.concatenate([x[s] for s in sub]), dtype)


@pytest.mark.parametrize("lowering", ["eager", "spmd"])
@pytest.mark.parametrize("kind", GROUP_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast(dtype, kind, lowering):
    group, family = make_group(kind)
    x = rank_data((3,), dtype, seed=5)
    src = jaxpg.get_global_rank(group, 1)
    got = per_rank(lowering, lambda v: jaxpg.broadcast(v, src=src, group=group), x, family)
    for sub in family:
        for r in sub:
            assert_close(got[r], x[sub[1]], dtype)
    if lowering == "spmd":
        assert_non_members_keep_input(got, x, family, dtype)


@pytest.mark.parametrize("lowering", ["eager", "spmd"])
@pytest.mark.parametrize("kind", GROUP_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_to_all(dtype, kind, lowering):
    group, family = make_group(kind)
    k = len(family[0])
    x = rank_data((k, 2), dtype, seed=6)
    if lowering == "eager":
        fn = lambda v: jaxpg.all_to_all([v[:, i] for i in range(k)], group=group)
    else:
        fn = lambda v: jaxpg.all_to_all([v[i] for i in range(k)], group=group)
    got = per_rank(lowering, fn, x, family)
    for sub in family:
        for j, r in enumerate(sub):
            for i, s in enumerate(sub):
                assert_close(got[r][i], x[s][j], dtype)


@pytest.mark.parametrize("lowering", ["eager", "spmd"])
@pytest.mark.parametrize("kind", GROUP_KINDS)
def test_all_to_all_single_even(kind, lowering):
    group, family = make_group(kind)
    k = len(family[0])
    x = rank_data((k * 2, 3), "float32", seed=7)
    got = per_rank(lowering, lambda v: jaxpg.all_to_all_single(v, group=group), x, family)
    for sub in family:
        for j, r in enumerate(sub):
            want = np.concatenate([x[s][2 * j: 2 * j + 2] for s in sub])
            assert_close(got[r], want, "float32")


@pytest.mark.parametrize("lowering", ["eager", "spmd"])
@pytest.mark.parametrize("kind", GROUP_KINDS)
@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_scatter(dtype, kind, lowering):
    group, family = make_group(kind)
    k = len(family[0])
    rows = rank_data((3,), dtype, seed=8)[:k]
    src = jaxpg.get_global_rank(group, 1)
    if lowering == "eager":
        out = np.asarray(jaxpg.scatter(scatter_list=list(rows), src=src, group=group))
        got = {r: out[i] for i, r in enumerate(members(family))}
    else:
        fn = lambda v: jaxpg.scatter(v, scatter_list=[rows[i] for i in range(k)], src=src,
                                     group=group)
        out = np.asarray(jaxpg.spmd(fn)(rank_data((3,), dtype)))
        got = {r: out[r] for r in range(8)}
    for sub in family:
        for j, r in enumerate(sub):
            assert_close(got[r], rows[j], dtype)


@pytest.mark.parametrize("lowering", ["eager", "spmd"])
@pytest.mark.parametrize("kind", GROUP_KINDS)
def test_gather(kind, lowering):
    group, family = make_group(kind)
    x = rank_data((2,), "float32", seed=9)
    dst = jaxpg.get_global_rank(group, 0)
    if lowering == "eager":
        got = jaxpg.gather(x[members(family)], dst=dst, group=group)
        assert len(got) == len(family[0])
        for i, s in enumerate(jaxpg.get_process_group_ranks(group)):
            assert_close(got[i], x[s], "float32")
    else:
        out = jax.device_get(jaxpg.spmd(lambda v: jaxpg.gather(v, dst=dst, group=group))(x))
        for sub in family:
            for i, s in enumerate(sub):
                assert_close(np.asarray(out[i])[sub[0]], x[s], "float32")


def test_all_gather_uneven_dim0_per_rank_arrays():
    sizes = [1, 3, 0, 2, 1, 1, 4, 2]
    arrays = tuple(np.full((n, 2), r, np.float32) for r, n in enumerate(sizes))
    out = jaxpg.all_gather(arrays)
    assert len(out) == 8
    for r, n in enumerate(sizes):
        got = np.asarray(out[r])
        assert got.shape == (8, n, 2)
        np.testing.assert_array_equal(got, np.full((8, n, 2), r, np.float32))


def test_all_to_all_uneven_pairs():
    # rank j sends i + j rows of value 10 * j + i to rank i
    k = 8
    nested = [[np.full((i + j, 1), 10 * j + i, np.int32) for i in range(k)] for j in range(k)]
    out = jaxpg.all_to_all(nested)
    for i in range(k):
        for j in range(k):
            np.testing.assert_array_equal(np.asarray(out[i][j]),
                                          np.full((i + j, 1), 10 * j + i, np.int32))


def test_all_to_all_single_uneven_splits():
    g = jaxpg.new_group([1, 4, 6])
    # group rank j sends split i of size (i + j + 1); values encode (sender, receiver)
    inputs, splits = [], []
    for j in range(3):
        sp = [i + j + 1 for i in range(3)]
        splits.append(sp)
        inputs.append(np.concatenate([np.full(sp[i], 10 * j + i, np.float32) for i in range(3)]))
    out = jaxpg.all_to_all_single(inputs, input_split_sizes=splits, group=g)
    for i in range(3):
        want = np.concatenate([np.full(i + j + 1, 10 * j + i, np.float32) for j in range(3)])
        np.testing.assert_array_equal(np.asarray(out[i]), want)
    with pytest.raises(ValueError, match="output_split_sizes"):
        jaxpg.all_to_all_single(inputs, input_split_sizes=splits,
                                output_split_sizes=[[1, 1, 1]] * 3, group=g)
