"""Context-parallel tests: an 8-rank world per test."""

import pytest


@pytest.fixture(autouse=True)
def fresh_world(world):
    """Every test here starts from a new 8-rank world (tests/conftest.py's ``world``)."""
    yield world
