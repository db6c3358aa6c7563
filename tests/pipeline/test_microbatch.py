"""split_microbatches / merge_microbatches."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpg.pipeline.stage.microbatch import merge_microbatches, microbatch_size, split_microbatches


def test_split_is_contiguous_and_merge_inverts():
    batch = {"x": jnp.arange(24.0).reshape(8, 3), "y": jnp.arange(8)}
    mbs = split_microbatches(batch, 4)
    assert mbs["x"].shape == (4, 2, 3) and mbs["y"].shape == (4, 2)
    np.testing.assert_array_equal(mbs["y"][1], [2, 3])
    merged = merge_microbatches(mbs)
    np.testing.assert_array_equal(merged["x"], batch["x"])
    np.testing.assert_array_equal(merged["y"], batch["y"])


def test_split_along_other_axis():
    x = jnp.arange(24.0).reshape(3, 8)
    mbs = split_microbatches(x, 2, axis=1)
    assert mbs.shape == (2, 3, 4)
    np.testing.assert_array_equal(mbs[1], x[:, 4:])
    np.testing.assert_array_equal(merge_microbatches(mbs, axis=1), x)


def test_not_divisible_names_sizes():
    with pytest.raises(ValueError, match=r"batch size 10 .*num_microbatches=4"):
        split_microbatches(jnp.zeros((10, 2)), 4)


def test_bad_arguments():
    with pytest.raises(TypeError, match="num_microbatches must be an int"):
        microbatch_size(jnp.zeros((4,)), 2.0)
    with pytest.raises(ValueError, match="at least 1"):
        microbatch_size(jnp.zeros((4,)), 0)
    with pytest.raises(ValueError, match=r"same size along dimension 0; got sizes \[3, 4\]"):
        microbatch_size({"a": jnp.zeros((4,)), "b": jnp.zeros((3,))}, 2)
