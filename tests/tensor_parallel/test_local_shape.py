"""local_shape: the per-device shape of a layout, against jax's own sharding of that layout."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.tensor_parallel import local_shape

pytestmark = pytest.mark.cpu_only  # 8 devices


@pytest.mark.parametrize("spec", [P(), P(None, "tp"), P("dp", "tp"), P(("dp", "tp"), None),
                                  P(None, ("tp", "dp")), P("tp")])
def test_local_shape_equals_the_shard_jax_places(spec):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))
    shape = (8, 16)
    placed = jax.device_put(np.zeros(shape, np.float32), NamedSharding(mesh, spec))
    assert {s.data.shape for s in placed.addressable_shards} == {local_shape(shape, spec, mesh)}
    assert local_shape(shape, spec, mesh) == NamedSharding(mesh, spec).shard_shape(shape)
