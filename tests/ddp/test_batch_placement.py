"""``shard_batch``: a batch already laid out as the group needs is used as it is."""

import jax
import numpy as np
import pytest
from _ddp_models import group

from jaxpg.ddp import param_sync


def test_an_array_on_the_one_device_of_a_one_rank_group_is_not_put_again(world):
    pg = group(1)
    x = jax.device_put(np.arange(12.0, dtype=np.float32).reshape(4, 3), pg.mesh.devices.flat[0])
    assert param_sync.shard_batch({"x": x}, pg)["x"] is x


def test_an_array_on_one_device_is_spread_over_a_larger_group(world):
    pg = group(2)
    host = np.arange(12.0, dtype=np.float32).reshape(4, 3)
    x = jax.device_put(host, pg.mesh.devices.flat[0])
    out = param_sync.shard_batch({"x": x}, pg)["x"]
    assert out is not x
    assert [s.data.shape for s in out.addressable_shards] == [(2, 3), (2, 3)]
    np.testing.assert_array_equal(np.asarray(out), host)


def test_a_leading_dimension_that_does_not_divide_is_named(world):
    with pytest.raises(ValueError, match=r"batch leaf \['x'\] has shape \(3, 2\)"):
        param_sync.shard_batch({"x": np.zeros((3, 2), np.float32)}, group(2))
