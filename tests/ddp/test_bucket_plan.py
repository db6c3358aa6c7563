"""make_bucket_plan against a literal transcription of torch's bucket assignment."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _require import import_or_skip

from jaxpg.ddp import make_bucket_plan

MIB = 1024 * 1024


def torch_reference(nbytes, dtypes, first_bytes, cap_bytes):
    """compute_bucket_assignment_by_size (reducer.cpp) + DDP's reversal, line by line."""
    bucket_size_limits = [first_bytes, cap_bytes]
    result = []
    limit_iterators = {}
    buckets = {}  # key -> {"indices": [...], "size": int}
    for i, (size, key) in enumerate(zip(nbytes, dtypes, strict=True)):
        bucket = buckets.setdefault(key, {"indices": [], "size": 0})
        bucket["indices"].append(i)
        bucket["size"] += size
        if key not in limit_iterators:
            limit_iterators[key] = 0
        limit = bucket_size_limits[limit_iterators[key]]
        if bucket["size"] >= limit:
            result.append(bucket["indices"])
            buckets[key] = {"indices": [], "size": 0}
            if limit_iterators[key] + 1 != len(bucket_size_limits):
                limit_iterators[key] += 1
    for bucket in buckets.values():
        if bucket["indices"]:
            result.append(bucket["indices"])
    result.sort(key=min)
    return list(reversed(result))


def _params(spec):
    """{'p00': ShapeDtypeStruct, ...} in the given order (names sort in order)."""
    return {
        f"p{i:02d}": jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
        for i, (shape, dtype) in enumerate(spec)
    }


def _check_against_reference(spec, cap_mb, first_mb):
    params = _params(spec)
    plan = make_bucket_plan(params, bucket_cap_mb=cap_mb, first_bucket_mb=first_mb)
    nbytes = [int(np.prod(s)) * jnp.dtype(d).itemsize for s, d in spec]
    dtypes = [jnp.dtype(d) for _, d in spec]
    expected = torch_reference(nbytes, dtypes, int(first_mb * MIB), int(cap_mb * MIB))
    assert [list(b.leaf_indices) for b in plan.buckets] == expected
    for index, bucket in enumerate(plan.buckets):
        assert bucket.index == index
        assert bucket.paths == tuple(f"['p{i:02d}']" for i in bucket.leaf_indices)
        assert {dtypes[i] for i in bucket.leaf_indices} == {bucket.dtype}
        assert bucket.nbytes == sum(nbytes[i] for i in bucket.leaf_indices)
        assert bucket.offsets == tuple(np.cumsum((0,) + bucket.sizes[:-1]).tolist())
    assert sorted(i for b in plan.buckets for i in b.leaf_indices) == list(range(len(spec)))
    return plan


MIXED = [
    ((256, 256), "float32"),  # 256 KiB
    ((256,), "float32"),
    ((512, 512), "bfloat16"),  # 512 KiB
    ((1024, 512), "float32"),  # 2 MiB
    ((512,), "bfloat16"),
    ((64, 64), "float16"),
    ((1024, 1024), "bfloat16"),  # 2 MiB
    ((1024,), "float32"),
    ((3,), "float16"),
]
BIG = [((8,), "float32"), ((2048, 2048), "float32"), ((16,), "float32"), ((32,), "float32")]
MANY_SMALL = [((37,), "float32")] * 20 + [((11, 3), "bfloat16")] * 7


@pytest.mark.parametrize(
    "spec, cap_mb, first_mb",
    [
        (MIXED, 25, 1),
        (MIXED, 1, 0.25),
        (MIXED, 0.5, 0.5),
        (BIG, 1, 1),  # a parameter (16 MiB) larger than the cap gets its own bucket
        (BIG, 25, 1),
        (MANY_SMALL, 0.001, 0.0005),  # tiny caps: ~1 KiB and ~512 B
        (MANY_SMALL, 1e-6, 1e-6),  # 1-byte limits: one bucket per parameter
        (MANY_SMALL, 25, 1),  # everything in one bucket per dtype
    ],
)
def test_matches_torch_reference(spec, cap_mb, first_mb):
    _check_against_reference(spec, cap_mb, first_mb)


TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


@pytest.mark.parametrize("spec, cap_mb, first_mb", [(MIXED, 1, 0.25), (BIG, 1, 1),
                                                    (MANY_SMALL, 0.001, 0.0005)])
def test_matches_torchs_own_bucket_assignment(spec, cap_mb, first_mb):
    """torch's C++ compute_bucket_assignment_by_size itself (not a transcription), reversed
    as DistributedDataParallel reverses it."""
    torch = import_or_skip("torch", "torch's DDP bucket assignment is the reference")
    from torch.distributed import _compute_bucket_assignment_by_size

    tensors = [torch.empty(shape, dtype=getattr(torch, TORCH_DTYPES[d])) for shape, d in spec]
    limits = [int(first_mb * MIB), int(cap_mb * MIB)]
    buckets, _ = _compute_bucket_assignment_by_size(tensors, limits)
    plan = make_bucket_plan(_params(spec), bucket_cap_mb=cap_mb, first_bucket_mb=first_mb)
    assert [list(b.leaf_indices) for b in plan.buckets] == list(reversed(buckets))


def test_first_bucket_and_reversal_by_hand():
    # 6 float32 params of 300 KiB; first limit 512 KiB, cap 1 MiB.
    spec = [((75 * 1024,), "float32")] * 6
    plan = make_bucket_plan(_params(spec), bucket_cap_mb=1, first_bucket_mb=0.5)
    # Definition order: [0, 1] closes at 600 KiB >= 512 KiB (the first limit);
    # [2, 3, 4] is 900 KiB < 1 MiB, so the cap closes the bucket only at 5.
    assert [b.leaf_indices for b in plan.buckets] == [(2, 3, 4, 5), (0, 1)]
    assert [b.size_limit for b in plan.buckets] == [MIB, MIB // 2]
    # The bucket holding the first-defined parameters is reduced last.
    assert plan.buckets[-1].paths == ("['p00']", "['p01']")


def test_each_dtype_has_its_own_first_bucket():
    spec = [((300 * 256,), "float32"), ((300 * 512,), "bfloat16")] * 3  # 300 KiB each
    plan = make_bucket_plan(_params(spec), bucket_cap_mb=25, first_bucket_mb=0.5)
    # float32: [0, 2] closes at 600 KiB; bfloat16: [1, 3] closes at 600 KiB; rest open.
    assert sorted(b.leaf_indices for b in plan.buckets) == [(0, 2), (1, 3), (4,), (5,)]
    assert [b.leaf_indices for b in plan.buckets] == [(5,), (4,), (1, 3), (0, 2)]


def test_arrays_and_shape_structs_give_the_same_plan():
    params = {
        "dense": {"kernel": jnp.zeros((64, 32)), "bias": jnp.zeros((32,))},
        "emb": jnp.zeros((100, 8), jnp.bfloat16),
    }
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    assert make_bucket_plan(params) == make_bucket_plan(shapes)
    assert make_bucket_plan(params) == make_bucket_plan(params)  # deterministic


def test_table_lists_buckets_and_paths():
    params = {
        "dense": {"kernel": jnp.zeros((64, 32)), "bias": jnp.zeros((32,))},
        "emb": jnp.zeros((100, 8), jnp.bfloat16),
    }
    plan = make_bucket_plan(params)
    text = str(plan)
    assert text == plan.table()
    assert "['dense']['kernel']" in text and "['emb']" in text
    assert "bfloat16" in text and "float32" in text
    assert str(64 * 32 * 4 + 32 * 4) in text
    assert len(plan) == 2 and plan.total_bytes == 64 * 32 * 4 + 32 * 4 + 100 * 8 * 2


def test_empty_tree_gives_no_buckets():
    assert len(make_bucket_plan({})) == 0


@pytest.mark.parametrize("name", ["bucket_cap_mb", "first_bucket_mb"])
@pytest.mark.parametrize(
    "value, error",
    [
        (0, ValueError),
        (-1, ValueError),
        (float("nan"), ValueError),
        (1e-12, ValueError),
        ("25", TypeError),
        (True, TypeError),
    ],
)
def test_bad_caps_name_the_argument(name, value, error):
    with pytest.raises(error, match=name):
        make_bucket_plan({"w": jnp.zeros(3)}, **{name: value})


def test_leaf_without_shape_is_rejected():
    with pytest.raises(TypeError, match=r"\['b'\]"):
        make_bucket_plan({"w": jnp.zeros(3), "b": "not an array"})
