"""Test setup: 8 simulated CPU devices, set before JAX is imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)


@pytest.fixture
def world():
    """An initialised 8-rank world on this process's simulated devices."""
    import jaxpg

    if jaxpg.is_initialized():
        jaxpg.destroy_process_group()
    jaxpg.init_process_group()
    yield jaxpg.GroupMember.WORLD
    if jaxpg.is_initialized():
        jaxpg.destroy_process_group()
