"""LeafSplit: padding, specs and the pad/unpad round trip against numpy slicing."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpg.data_parallel.leaf_split import (
    LeafSplit,
    leaf_split_bytes,
    make_leaf_splits,
    pad_leaf,
    unpad_leaf,
)


@pytest.mark.parametrize("shape, n, padded", [
    ((10, 3), 4, (12, 3)),   # odd dim 0: padded
    ((8, 3), 4, (8, 3)),     # divisible: no padding
    ((1, 5), 8, (8, 5)),     # smaller than the group
    ((7,), 2, (8,)),
    ((), 4, ()),             # scalars stay replicated
])
def test_padded_shapes_and_round_trip(shape, n, padded):
    lay = LeafSplit.of(shape, "float32", n)
    assert lay.padded_shape == padded
    assert lay.sharded == bool(shape)
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    p = np.asarray(pad_leaf(jnp.asarray(x), lay))
    assert p.shape == padded
    if shape:
        np.testing.assert_array_equal(p[: shape[0]], x)
        assert not p[shape[0]:].any()  # zero rows at the end
        assert lay.shard_shape == (padded[0] // n, *shape[1:])
    np.testing.assert_array_equal(np.asarray(unpad_leaf(jnp.asarray(p), lay)), x)


def test_specs_compose_with_other_axes():
    assert LeafSplit.of((8, 4), "float32", 2).spec(("dp",)) == P("dp")
    assert LeafSplit.of((8, 4), "float32", 2).spec(("r", "s")) == P(("r", "s"))
    # a column-parallel kernel split over tp on dim 1: dp is added on dim 0
    col = LeafSplit.of((8, 4), "float32", 2, base_spec=P(None, "tp"))
    assert col.spec(("dp",)) == P("dp", "tp")
    # a row-parallel kernel split over tp on dim 0: each tp block is split over dp
    row = LeafSplit.of((8, 4), "float32", 2, dim0_blocks=2, base_spec=P("tp", None))
    assert row.spec(("dp",)) == P(("tp", "dp"))
    assert LeafSplit.of((), "float32", 2).spec(("dp",)) == P()


def test_blocks_pad_each_tensor_parallel_block_alone():
    lay = LeafSplit.of((6, 2), "float32", 2, dim0_blocks=2, base_spec=P("tp"))
    assert lay.block_dim0 == 3 and lay.padded_shape == (8, 2)
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    p = np.asarray(pad_leaf(jnp.asarray(x), lay))
    want = np.concatenate([x[:3], np.zeros((1, 2)), x[3:], np.zeros((1, 2))])
    np.testing.assert_array_equal(p, want)
    np.testing.assert_array_equal(np.asarray(unpad_leaf(jnp.asarray(p), lay)), x)


def test_another_dimension_for_stage_stacks():
    lay = LeafSplit.of((4, 5, 3), "float32", 2, dim=1, base_spec=P("pp"))
    assert lay.padded_shape == (4, 6, 3) and lay.shard_shape == (4, 3, 3)
    assert lay.spec(("dp",)) == P("pp", "dp")
    x = np.arange(60, dtype=np.float32).reshape(4, 5, 3)
    p = np.asarray(pad_leaf(jnp.asarray(x), lay))
    np.testing.assert_array_equal(p[:, :5], x)
    assert not p[:, 5:].any()
    assert LeafSplit.of((4,), "float32", 2, dim=1).sharded is False


def test_make_layouts_and_bytes():
    tree = {"w": np.zeros((10, 3), np.float32), "b": np.zeros((3,), np.float32)}
    layouts = make_leaf_splits(tree, 4)
    assert layouts["w"].padded_shape == (12, 3) and layouts["b"].padded_shape == (4,)
    assert leaf_split_bytes(layouts, per_rank=False) == (36 + 4) * 4
    assert leaf_split_bytes(layouts, per_rank=True) == (9 + 1) * 4


def test_bad_layouts():
    with pytest.raises(ValueError, match="num_shards=0"):
        LeafSplit.of((4,), "float32", 0)
    with pytest.raises(ValueError, match="does not split into dim0_blocks=3"):
        LeafSplit.of((4, 2), "float32", 2, dim0_blocks=3)
