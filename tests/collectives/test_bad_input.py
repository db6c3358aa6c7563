"""Bad input gets a clear error naming the argument and value, before anything runs."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxpg
from jaxpg import ReduceOp


@pytest.mark.parametrize("op,dtype,match", [
    (ReduceOp.BAND, "float32", "bitwise reduction and needs an integer or bool"),
    (ReduceOp.BXOR, "bfloat16", "bitwise"),
    (ReduceOp.MIN, "complex64", "not defined for complex"),
    (ReduceOp.PRODUCT, "complex64", "not defined for complex"),
    (ReduceOp.AVG, "int32", "needs a floating-point or complex array"),
])
def test_op_invalid_for_dtype(op, dtype, match):
    with pytest.raises(ValueError, match=match):
        jaxpg.all_reduce(jnp.zeros((8, 2), dtype), op=op)


def test_premul_sum_needs_factor_and_ops_are_typed():
    with pytest.raises(ValueError, match="needs a factor"):
        jaxpg.all_reduce(jnp.zeros((8, 2)), op=ReduceOp.PREMUL_SUM)
    with pytest.raises(TypeError, match="op must be a jaxpg.ReduceOp"):
        jaxpg.all_reduce(jnp.zeros((8, 2)), op="sum")
    with pytest.raises(TypeError, match="scalar factor"):
        ReduceOp.PREMUL_SUM([1, 2])
    assert repr(ReduceOp.PREMUL_SUM(2)) == "ReduceOp.PREMUL_SUM(2.0)"


def test_complex_sum_works():
    x = (np.arange(8) + 1j * np.arange(8)).astype(np.complex64)[:, None]
    np.testing.assert_allclose(np.asarray(jaxpg.all_reduce(x))[0, 0], 28 + 28j)


def test_stacked_input_must_match_local_ranks():
    with pytest.raises(ValueError, match="leading axis of size 8; got shape \\(3,\\)"):
        jaxpg.all_reduce(jnp.zeros(3))


def test_list_lengths_and_shapes():
    with pytest.raises(ValueError, match="list of group size 8 arrays; got 3"):
        jaxpg.reduce_scatter([jnp.zeros((8, 2))] * 3)
    with pytest.raises(ValueError, match="chunks of different shapes"):
        jaxpg.reduce_scatter([jnp.zeros((8, 2))] * 7 + [jnp.zeros((8, 3))])
    with pytest.raises(ValueError, match="need 8 chunks"):
        jaxpg.all_to_all([jnp.zeros((8, 1))] * 2)
    with pytest.raises(ValueError, match="multiple of the group size 8"):
        jaxpg.reduce_scatter_tensor(jnp.zeros((8, 7)))
    with pytest.raises(ValueError, match="input_split_sizes"):
        jaxpg.all_to_all_single(jnp.zeros((8, 8)), input_split_sizes=[1] * 7)


def test_scatter_list_on_wrong_rank():
    g = jaxpg.new_group([1, 2])
    with pytest.raises(ValueError, match="must pass scatter_list with 2 arrays"):
        jaxpg.scatter(jnp.zeros((2, 3)), src=1, group=g)
    with pytest.raises(ValueError, match="scatter_list has 3 arrays; the group has 2"):
        jaxpg.scatter(scatter_list=[jnp.zeros(3)] * 3, src=1, group=g)


def test_src_dst_must_be_group_members():
    g = jaxpg.new_group([1, 2])
    with pytest.raises(ValueError, match="src=0 is not a rank of group"):
        jaxpg.broadcast(jnp.zeros((2, 1)), src=0, group=g)
    with pytest.raises(ValueError, match="group_dst=5 is out of range"):
        jaxpg.reduce(jnp.zeros((2, 1)), group=g, group_dst=5)


def test_spmd_group_outside_the_mesh():
    sub = jaxpg.new_group([0, 1])
    other = jaxpg.new_group([2, 3])
    f = jaxpg.spmd(lambda v: jaxpg.all_reduce(v, group=other), group=sub)
    with pytest.raises(ValueError, match=r"ranks \[2, 3\] that are not on the mesh"):
        f(jnp.zeros((2, 1)))


def test_barrier_in_spmd_is_refused_and_works_eagerly():
    assert jaxpg.barrier() is None
    assert jaxpg.barrier(async_op=True).wait()
    with pytest.raises(ValueError, match="needs no barrier"):
        jaxpg.spmd(lambda v: jaxpg.barrier())(jnp.zeros((8, 1)))
    jaxpg.monitored_barrier(wait_all_ranks=True)
