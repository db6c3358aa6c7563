"""Bad input gets a clear error, raised before anything runs or changes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpg
from jaxpg.ddp import DistributedDataParallel
from jaxpg.internal import resolve_mesh_axis
from jaxpg.pipeline import StagedParams, pipeline_value_and_grad
from jaxpg.tensor_parallel import (
    ColumnParallelLinear,
    ColwiseParallel,
    ParallelCrossEntropy,
    Partial,
    PrepareModuleInput,
    Replicate,
    RowwiseParallel,
    Shard,
    VocabParallelEmbedding,
    distribute_tensor,
    parallel_style_of,
    parallelize_module,
    param_specs,
    to_global,
)


class Mlp(nnx.Module):
    def __init__(self, hidden=16):
        self.norm = nnx.LayerNorm(8, rngs=nnx.Rngs(0))
        self.up = nnx.Linear(8, hidden, rngs=nnx.Rngs(0))
        self.down = nnx.Linear(hidden, 8, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.down(self.up(self.norm(x)))


@pytest.fixture
def tp4():
    return jaxpg.init_device_mesh((2, 4), ("dp", "tp"))


def test_a_plan_key_that_matches_nothing_names_the_key_and_the_submodules(tp4):
    model = Mlp()
    with pytest.raises(ValueError, match=r"plan key 'mlp\.up' matches no submodule of Mlp; "
                                         r"its submodules are: down, norm, up"):
        parallelize_module(model, tp4["tp"], {"up": ColwiseParallel(),
                                              "mlp.up": ColwiseParallel()})
    assert parallel_style_of(model.up) is None  # checked before anything changed
    assert not hasattr(model.up.kernel[...].sharding, "spec")  # still a plain array


def test_a_style_on_a_module_it_cannot_shard(tp4):
    with pytest.raises(TypeError, match="plan key 'norm' matches a LayerNorm, which "
                                        "ColwiseParallel cannot shard"):
        parallelize_module(Mlp(), tp4["tp"], {"norm": ColwiseParallel()})
    with pytest.raises(TypeError, match="is not a parallel style"):
        parallelize_module(Mlp(), tp4["tp"], {"up": "colwise"})


def test_a_dimension_the_tp_size_does_not_divide(tp4):
    with pytest.raises(ValueError, match=r"tp_size=4 must divide up\.out_features=6"):
        parallelize_module(Mlp(6), tp4["tp"], {"up": ColwiseParallel()})
    with pytest.raises(ValueError, match=r"tp_size=4 must divide down\.in_features=6"):
        parallelize_module(Mlp(6), tp4["tp"], {"down": RowwiseParallel()})
    with pytest.raises(ValueError, match="tp_size=4 must divide out_features=6"):
        ColumnParallelLinear(8, 6, mp_group=tp4["tp"], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="tp_size=4 must divide num_embeddings=30"):
        VocabParallelEmbedding(30, 8, mp_group=tp4["tp"], rngs=nnx.Rngs(0))


def test_a_group_that_is_not_one_dimension_of_a_mesh(tp4):
    with pytest.raises(ValueError, match=r"2-D DeviceMesh with dimensions \('dp', 'tp'\).*"
                                         r"device_mesh=mesh\['tp'\]"):
        parallelize_module(Mlp(), tp4, {"up": ColwiseParallel()})
    uneven, _ = jaxpg.new_subgroups_by_enumeration([[0, 1, 2], [3, 4, 5, 6, 7]])
    with pytest.raises(ValueError, match="family of uneven subgroups.*not one dimension"):
        ColumnParallelLinear(8, 8, mp_group=uneven, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="ColumnParallelLinear: mp_group= takes a ProcessGroup"):
        resolve_mesh_axis("tp", "tp", api="ColumnParallelLinear", arg="mp_group")


def test_a_rank_outside_the_group(tp4):
    with pytest.raises(ValueError, match="not a member of the group"):
        ColumnParallelLinear(8, 8, mp_group=jaxpg.GroupMember.NON_GROUP_MEMBER)
    layer = VocabParallelEmbedding(8, 4, mp_group=jaxpg.new_group([0, 1]), rngs=nnx.Rngs(0))
    with jaxpg.as_rank(1):
        assert layer.rank == 1 and layer.vocab_start_index == 4
    with jaxpg.as_rank(5), pytest.raises(ValueError, match="acting rank 5 is not on the "
                                                           "tensor-parallel mesh"):
        _ = layer.rank
    with pytest.raises(ValueError, match="src_data_rank=4 is not a rank of the "
                                         "tensor-parallel group of size 4"):
        distribute_tensor(np.zeros((4, 4)), tp4["tp"], P(), src_data_rank=4)


def test_no_hybrid_communicate_group_for_the_default_group():
    with pytest.raises(ValueError, match="no HybridCommunicateGroup exists"):
        ColumnParallelLinear(8, 8, rngs=nnx.Rngs(0))
    hcg = jaxpg.HybridCommunicateGroup(dp_degree=4, mp_degree=2)
    assert ColumnParallelLinear(8, 8, rngs=nnx.Rngs(0)).world_size == 2
    assert jaxpg.get_hybrid_communicate_group() is hcg


def test_plans_that_name_a_module_twice_or_twice_over(tp4):
    with pytest.raises(ValueError, match="'up' matches plan keys 'up' and 'u\\*'"):
        parallelize_module(Mlp(), tp4["tp"], {"up": ColwiseParallel(), "u*": ColwiseParallel()})
    model = parallelize_module(Mlp(), tp4["tp"], {"up": ColwiseParallel()})
    with pytest.raises(ValueError, match="'up' is already parallelized with ColwiseParallel"):
        parallelize_module(model, tp4["tp"], {"up": ColwiseParallel()})
    with pytest.raises(ValueError, match="must both be given"):
        PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(),))
    with pytest.raises(TypeError, match="input_layouts='Shard' must be a placement"):
        ColwiseParallel(input_layouts="Shard")


def test_misuse_inside_and_outside_spmd_code(tp4):
    layer = ColumnParallelLinear(8, 8, mp_group=tp4["tp"], rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    replicated = jax.tree.map(lambda _: P(), state)  # full weights: not the layer's shards
    run = jax.shard_map(lambda s, x: nnx.merge(graphdef, s)(x), mesh=tp4.jax_mesh,
                        in_specs=(replicated, P()), out_specs=P(), check_vma=False)
    with pytest.raises(ValueError, match=r"inside SPMD code weight has its full shape \(8, 8\)"):
        run(state, jnp.ones((2, 8)))
    other = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    run = jax.shard_map(lambda s, x: nnx.merge(graphdef, s)(x), mesh=other,
                        in_specs=(param_specs(state), P()), out_specs=P(), check_vma=False)
    with pytest.raises(ValueError, match="binds axis 'tp' with size 2, but the tensor-parallel "
                                         "group has 4 ranks"):
        run(jax.tree.map(np.asarray, state), np.ones((2, 8), np.float32))
    with pytest.raises(ValueError, match="Partial\\(\\) describes per-rank summands"):
        to_global(np.ones((2, 8)), Partial(), layer.tp)
    with pytest.raises(ValueError, match="labels of shape \\(3,\\) do not match logits"):
        ParallelCrossEntropy(mp_group=tp4["tp"])(jnp.ones((2, 8)), jnp.zeros(3, jnp.int32))


def test_ddp_and_pipeline_refuse_layouts_they_cannot_run(tp4):
    model = parallelize_module(Mlp(), tp4["tp"], {"up": ColwiseParallel(),
                                                  "down": RowwiseParallel()})
    with pytest.raises(ValueError, match=r"\['down'\]\['kernel'\].* is split over "
                                         r"the data-parallel axes \['tp'\]"):
        DistributedDataParallel(model, optax.sgd(0.1))  # the world group: dp x tp
    with pytest.raises(ValueError, match="is not one dimension of it; pass the data-parallel "
                                         "dimension's group"):
        DistributedDataParallel(model, optax.sgd(0.1), group=jaxpg.new_group([0, 1, 2, 3]))
    ddp = DistributedDataParallel(model, optax.sgd(0.1), group=tp4.get_group("dp"))
    with pytest.raises(ValueError, match="uneven inputs are not supported"):
        ddp.join()
    with pytest.raises(NotImplementedError, match=r"no one device holds a replica .* use "
                                                  r"ddp.module\(x\)"):
        ddp(np.ones((2, 8), np.float32))
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(ddp.module(x)), np.asarray(Mlp()(x)), rtol=1e-5,
                               atol=1e-6)  # what the error advises: the whole model
    hcg = jaxpg.HybridCommunicateGroup(dp_degree=2, pp_degree=2, mp_degree=2)
    params = StagedParams({"w": jnp.ones((2, 4, 4))}, {}, {})
    with pytest.raises(ValueError, match="names mesh axis 'pp'"):
        pipeline_value_and_grad(lambda w, x: x @ w["w"], lambda _, y, t: jnp.mean(y), params,
                                jnp.ones((4, 4)), jnp.ones((4, 4)), mesh=hcg, num_microbatches=2,
                                param_specs=StagedParams({"w": P("pp")}, {}, {}))
