"""Bad input gets a clear error before anything runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpg
from jaxpg import context_parallel as cp_


def _stacked(n, seq_local=4, heads=4):
    return jnp.zeros((n, 1, seq_local, heads, 8), jnp.float32)


def test_sequence_not_divisible_by_cp_or_2cp():
    group = jaxpg.new_group(list(range(4)))
    with pytest.raises(ValueError, match=r"sequence length 6 .* not divisible by cp = 4"):
        cp_.shard_sequence(np.zeros((1, 6, 2)), group)
    with pytest.raises(ValueError, match=r"not divisible by 2 \* cp = 8.*load_balance=False"):
        cp_.shard_sequence(np.zeros((1, 12, 2)), group, load_balance=True)


def test_load_balance_needs_an_even_local_sequence():
    group = jaxpg.new_group(list(range(2)))
    q = _stacked(2, seq_local=3)
    with pytest.raises(ValueError, match="load_balance=True needs an even seq_local"):
        cp_.attention(q, q, q, group=group, causal=True)


def test_all_to_all_needs_heads_divisible_by_cp():
    group = jaxpg.new_group(list(range(4)))
    q = _stacked(4, heads=6)
    with pytest.raises(ValueError, match=r"heads must be divisible by cp=4; got heads=6"):
        cp_.attention(q, q, q, group=group, method="all_to_all")


def test_shards_of_different_shapes_and_unknown_method():
    group = jaxpg.new_group(list(range(2)))
    q, k = _stacked(2, seq_local=4), _stacked(2, seq_local=2)
    with pytest.raises(ValueError, match=r"same per-rank shape .* k \(1, 2, 4, 8\)"):
        cp_.attention(q, k, k, group=group)
    with pytest.raises(ValueError, match=r"method='flash' is not one of"):
        cp_.attention(q, q, q, group=group, method="flash")
    with pytest.raises(ValueError, match=r"expected 4 dimensions .* after the leading stacked"):
        cp_.attention(q[0], q[0], q[0], group=group)
    with pytest.raises(ValueError, match=r"leading axis must stack this process's 2 ranks"):
        cp_.attention(*[_stacked(4)] * 3, group=group)


def test_group_not_one_mesh_dimension():
    mesh = jaxpg.init_device_mesh((2, 4), ("dp", "cp"))
    q = _stacked(8)
    with pytest.raises(ValueError,
                       match=r"group= runs over one axis.*2-D DeviceMesh.*group=mesh\['cp'\]"):
        cp_.attention(q, q, q, group=mesh)
    uneven, _ = jaxpg.new_subgroups_by_enumeration([[0, 1, 2], [3, 4, 5, 6, 7]])
    with pytest.raises(ValueError, match="uneven subgroups"):
        cp_.attention(q, q, q, group=uneven)


def test_spmd_over_another_axis_size():
    # spmd over the 8-rank world, attention over a 2-rank group of a mesh: refused at trace.
    group = jaxpg.init_device_mesh((4, 2), ("dp", "cp"))["cp"].get_group()
    world_axis_sized = jaxpg.spmd(lambda q: cp_.attention(q, q, q, group=group))
    with pytest.raises(ValueError, match=r"inside SPMD code that does not bind the "
                                         r"context-parallel axis 'cp' \(size 2\)"):
        jax.eval_shape(world_axis_sized, jnp.zeros((8, 1, 4, 2, 8)))


def test_unshard_with_another_load_balance_than_shard():
    group = jaxpg.new_group(list(range(2)))
    x = np.arange(8.0).reshape(1, 8)
    shards = cp_.shard_sequence(x, group, load_balance=True)
    with pytest.raises(ValueError, match=r"load_balance=False but the shards were made by "
                                         r"shard_sequence\(\.\.\., load_balance=True\)"):
        cp_.unshard_sequence(shards, group, load_balance=False)
    # and the record makes the round trip right without repeating the flag
    np.testing.assert_array_equal(np.asarray(cp_.unshard_sequence(shards, group)), x)
    np.testing.assert_array_equal(np.asarray(shards.position_ids),
                                  [[0, 1, 6, 7], [2, 3, 4, 5]])
