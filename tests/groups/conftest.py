import pytest

import jaxpg


@pytest.fixture(autouse=True)
def fresh_world():
    """Each test starts from a new 8-rank world on the simulated devices."""
    if jaxpg.is_initialized():
        jaxpg.destroy_process_group()
    jaxpg.init_process_group()
    yield
    if jaxpg.is_initialized():
        jaxpg.destroy_process_group()
