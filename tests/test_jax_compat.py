"""jaxpg._jax_compat: every private jax API resolves on the running jax, and a missing one
raises an error naming the jax version and the feature."""

import jax
import pytest

from jaxpg import _jax_compat
from jaxpg.errors import DistBackendError


def test_every_accessor_is_listed_with_the_versions_it_was_checked_on():
    accessors = set(_jax_compat.__all__) - {"CHECKED_ON", "JaxCompatError"}
    assert set(_jax_compat.CHECKED_ON) == accessors
    assert all(_jax_compat.CHECKED_ON.values())


def test_every_private_api_resolves_on_this_jax():
    # Resolve each without calling what would start a service or a backend.
    resolved = [
        _jax_compat._resolve("jax._src.distributed", "global_state", "x"),
        _jax_compat._resolve("jax._src.xla_bridge", "backends_are_initialized", "x"),
        _jax_compat._resolve("jax._src.config", "cpu_collectives_implementation", "x"),
        _jax_compat._resolve("jax._src.xla_bridge", "make_cpu_client", "x"),
        _jax_compat._resolve("jax._src.xla_bridge", "_backend_factories", "x"),
        _jax_compat._resolve("jax._src.xla_bridge", "register_backend_factory", "x"),
        _jax_compat._resolve("jax._src.array", "ArrayImpl", "x"),
    ] + [_jax_compat._jaxlib(name, "x") for name in (
        "get_distributed_runtime_client", "get_distributed_runtime_service",
        "make_gloo_tcp_collectives", "make_mpi_collectives")]
    assert all(r is not None for r in resolved)
    assert hasattr(_jax_compat.distributed_state(), "client")
    assert isinstance(_jax_compat.backends_are_initialized(), bool)
    assert _jax_compat.cpu_collectives_implementation() in (None, "gloo", "mpi", "megascale")
    assert callable(_jax_compat.cpu_backend_factory())


def test_a_missing_private_api_names_the_version_and_the_feature():
    with pytest.raises(_jax_compat.JaxCompatError) as info:
        _jax_compat._resolve("jax._src.distributed", "no_such_state", "the coordination client")
    message = str(info.value)
    assert f"jax {jax.__version__}" in message
    assert "jax._src.distributed.no_such_state" in message
    assert "the coordination client" in message
    assert isinstance(info.value, DistBackendError)


def test_array_from_single_block_is_the_block_as_a_global_array():
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    device = jax.devices()[0]
    mesh = Mesh(np.array([device]), ("x",))
    block = jax.device_put(np.arange(6.0, dtype=np.float32).reshape(1, 6), device)
    out = _jax_compat.array_from_single_block((1, 6), NamedSharding(mesh, P("x")), block)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(block))
    assert out.sharding == NamedSharding(mesh, P("x"))
