"""The grouped-matmul kernels need no world of ranks: they run on one device, the GPU too."""

import pytest


@pytest.fixture(autouse=True)
def fresh_world():
    """Overrides tests/expert_parallel's 8-rank world: these tests take no group."""
    yield None
