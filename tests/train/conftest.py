"""Recipe tests: an 8-rank world per test (tests/conftest.py's ``world``)."""

import pytest


@pytest.fixture(autouse=True)
def fresh_world(world):
    yield world
