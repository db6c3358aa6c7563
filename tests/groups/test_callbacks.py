"""The callbacks through which the layers above ``groups`` act on it (no upward imports)."""

import jax.numpy as jnp
import numpy as np

import jaxpg
from jaxpg.collectives import eager
from jaxpg.groups import callbacks


def test_destroy_process_group_clears_the_eager_kernels():
    _ = jaxpg.all_reduce(jnp.ones((8, 2)))  # compiles and caches a kernel
    assert eager._kernels  # compiled and cached
    assert eager.clear_kernel_cache in callbacks._resets
    jaxpg.destroy_process_group()
    assert not eager._kernels and not eager._plans
    jaxpg.init_process_group()
    np.testing.assert_array_equal(jaxpg.all_reduce(jnp.ones((8, 2))), np.full((8, 2), 8.0))


def test_reset_callbacks_run_once_each_in_order(monkeypatch):
    monkeypatch.setattr(callbacks, "_resets", [])
    calls = []
    first = callbacks.on_reset(lambda: calls.append("first"))
    callbacks.on_reset(lambda: calls.append("second"))
    callbacks.on_reset(first)  # registering again changes nothing
    jaxpg.destroy_process_group()
    assert calls == ["first", "second"]
    jaxpg.init_process_group()


def test_get_rank_is_traced_in_spmd_code_and_plain_in_host_code():
    evens = jaxpg.new_group([0, 2, 4, 6])
    ranks = jaxpg.spmd(lambda x: x * 0 + jnp.stack([jaxpg.get_rank(), jaxpg.get_rank(evens)]))(
        jnp.zeros((8, 2), jnp.int32))
    np.testing.assert_array_equal(ranks[:, 0], np.arange(8))
    np.testing.assert_array_equal(ranks[:, 1], [0, -1, 1, -1, 2, -1, 3, -1])
    assert callbacks.traced_rank(evens) is None  # host code: no SPMD context
    with jaxpg.as_rank(4):
        assert jaxpg.get_rank(evens) == 2
