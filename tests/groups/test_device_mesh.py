"""DeviceMesh and HybridCommunicateGroup against the rank arithmetic they stand for."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpg


def test_device_mesh_groups_and_coordinates():
    mesh = jaxpg.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "pp"))
    assert mesh.shape == (2, 4)
    with jaxpg.as_rank(6):
        assert mesh.get_coordinate() == [1, 2]
        assert mesh.get_local_rank("dp") == 1 and mesh.get_local_rank("pp") == 2
        assert mesh.get_group("dp").ranks == (2, 6)
        assert mesh["pp"].mesh.tolist() == [4, 5, 6, 7]
    assert mesh.get_group("pp").ranks == (0, 1, 2, 3)
    assert mesh["dp"].mesh.tolist() == [0, 4]
    assert mesh.jax_mesh.axis_names == ("dp", "pp")
    assert mesh.size() == 8 and mesh.size("pp") == 4


def test_device_mesh_axis_group_lowers_to_native_psum():
    mesh = jaxpg.init_device_mesh((2, 4), ("dp", "pp"))
    f = jaxpg.spmd(lambda v: jaxpg.all_reduce(v, group=mesh.get_group("pp")), mesh=mesh,
                   in_specs=P(("dp", "pp")), out_specs=P(("dp", "pp")))
    x = jnp.arange(8.0)
    np.testing.assert_array_equal(np.asarray(f(x)), [6, 6, 6, 6, 22, 22, 22, 22])
    text = str(jnp.asarray(0) if False else __import__("jax").make_jaxpr(f)(x))
    assert "psum" in text and "ppermute" not in text


def test_device_mesh_bad_input():
    with pytest.raises(ValueError, match="must multiply to the world size 8"):
        jaxpg.init_device_mesh((3, 2), ("a", "b"))
    with pytest.raises(ValueError, match="distinct names"):
        jaxpg.init_device_mesh((2, 4), ("a", "a"))
    with pytest.raises(ValueError, match="does not match JAX's platform"):
        jaxpg.init_device_mesh("cuda", (8,), mesh_dim_names=("x",))
    mesh = jaxpg.init_device_mesh((2, 4), ("dp", "pp"))
    with pytest.raises(KeyError, match="'tp' is not one of"):
        mesh.get_group("tp")


def test_flatten_is_the_rank_arithmetic_and_torchs_flatten_is_the_same():
    # (dp, cp, tp) = (2, 2, 2): a rank's dp_cp group is the ranks of its tp coordinate,
    # row-major over (dp, cp)
    want = np.arange(8).reshape(2, 2, 2).transpose(2, 0, 1).reshape(2, 4)
    public = jaxpg.init_device_mesh((2, 2, 2), ("dp", "cp", "tp"))
    torch_spelling = jaxpg.init_device_mesh((2, 2, 2), ("dp", "cp", "tp"))
    flat = public["dp", "cp"].flatten("dp_cp")
    alias = torch_spelling["dp", "cp"]._flatten("dp_cp")
    assert flat.mesh_dim_names == alias.mesh_dim_names == ("dp_cp",)
    for rank in (0, 5):
        with jaxpg.as_rank(rank):
            assert public["dp_cp"].mesh.tolist() == want[rank % 2].tolist()
            assert torch_spelling["dp_cp"].mesh.tolist() == want[rank % 2].tolist()
    assert sorted(public.get_group("dp_cp").family) == sorted(
        torch_spelling.get_group("dp_cp").family) == sorted(tuple(r) for r in want.tolist())
    assert public["dp", "cp"].flatten().mesh_dim_names == ("dp_cp",)  # the default name
    assert jaxpg.DeviceMesh._flatten is jaxpg.DeviceMesh.flatten  # one implementation
    with pytest.raises(ValueError, match=r"DeviceMesh.flatten: mesh_dim_name='tp' is already"):
        public["dp", "cp"].flatten("tp")


def test_hybrid_communicate_group():
    hcg = jaxpg.HybridCommunicateGroup(dp_degree=2, pp_degree=2, mp_degree=2)
    # ranks laid out (dp, pp, mp), mp innermost: rank = dp*4 + pp*2 + mp
    with jaxpg.as_rank(6):  # dp=1, pp=1, mp=0
        assert hcg.get_data_parallel_rank() == 1
        assert hcg.get_stage_id() == 1 and hcg.is_last_stage() and not hcg.is_first_stage()
        assert hcg.get_model_parallel_rank() == 0
        assert hcg.get_p2p_prev_rank() == 4 and hcg.get_p2p_next_rank() == 4
        assert hcg.get_data_parallel_group().ranks == (2, 6)
        assert hcg.get_model_parallel_group().ranks == (6, 7)
        assert hcg.get_pipe_parallel_group().ranks == (4, 6)
    assert hcg.get_data_parallel_world_size() == 2
    assert hcg.get_pipe_parallel_world_size() == 2
    assert hcg.get_model_parallel_world_size() == 2
    hcg4 = jaxpg.HybridCommunicateGroup(dp_degree=2, pp_degree=4)
    with jaxpg.as_rank(3):
        assert hcg4.get_p2p_next_rank() == 0 and hcg4.get_p2p_prev_rank() == 2


def test_hybrid_bad_degrees():
    with pytest.raises(ValueError, match="must equal the world size 8"):
        jaxpg.HybridCommunicateGroup(dp_degree=3, pp_degree=2)
    with pytest.raises(ValueError, match="pp_degree=0 must be an int >= 1"):
        jaxpg.HybridCommunicateGroup(dp_degree=8, pp_degree=0)
