"""Tensor-parallel tests: an 8-rank world, and ("dp", "tp") meshes with tp = 2 and 4."""

import pytest

import jaxpg


@pytest.fixture(autouse=True)
def fresh_world(world):
    """Every test here starts from a new 8-rank world (tests/conftest.py's ``world``)."""
    yield world


@pytest.fixture(params=[2, 4], ids=["tp2", "tp4"])
def mesh(request):
    """A DeviceMesh of the 8 ranks, ("dp", "tp") = (8 // tp, tp)."""
    return jaxpg.init_device_mesh((8 // request.param, request.param), ("dp", "tp"))
