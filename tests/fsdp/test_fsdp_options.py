"""Units, options, mixed-precision policy and the errors for bad input (nothing compiled
except where a unit is called)."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _fsdp_models import Block, Net, group, make_batches
from _require import import_or_skip
from flax import nnx

import jaxpg
from jaxpg.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy
from jaxpg.fsdp.collectives import divide_factors

OPT = optax.adam(1e-2)


@pytest.mark.parametrize("units, want", [
    (None, ()),
    (["blocks.0"], ("blocks.0",)),
    ("blocks.*", ("blocks.0", "blocks.1")),
    (Block, ("blocks.0", "blocks.1")),
    ((Block, nnx.Linear), None),  # nests: refused below
    (lambda path, m: path in ("embed", "head"), ("embed", "head")),
])
def test_units_are_resolved_from_paths_classes_and_predicates(world, units, want):
    if want is None:
        with pytest.raises(ValueError, match="units nest: 'blocks.0.lin' is inside 'blocks.0'"):
            FullyShardedDataParallel(Net(0), OPT, group=group(2), units=units)
        return
    fsdp = FullyShardedDataParallel(Net(0), OPT, group=group(2), units=units)
    assert fsdp.units == want
    table = fsdp.describe()
    assert "stage 3" in table and "<root>" in table
    for unit in want:
        assert f"  {unit}: 2 params" in table


def test_units_that_match_nothing_name_the_model_paths(world):
    with pytest.raises(ValueError, match=r"units entry 'layers\.\*' matches no submodule.*"
                                         r"'blocks\.0'"):
        FullyShardedDataParallel(Net(0), OPT, group=group(2), units=["blocks.0", "layers.*"])
    with pytest.raises(ValueError, match="matches no submodule of Net"):
        FullyShardedDataParallel(Net(0), OPT, group=group(2), units=nnx.Conv)
    with pytest.raises(TypeError, match="units=3 must be None"):
        FullyShardedDataParallel(Net(0), OPT, group=group(2), units=3)


def test_units_must_own_parameters(world):
    class Tied(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0)
            self.a = nnx.Linear(4, 4, rngs=rngs)
            self.b = nnx.Linear(4, 4, rngs=rngs)
            self.b.kernel = self.a.kernel  # tied

        def __call__(self, x):
            return self.b(self.a(x))

    with pytest.raises(ValueError,
                       match="parameter 'b.kernel' of unit 'b' is shared with 'a.kernel'"):
        FullyShardedDataParallel(Tied(), OPT, group=group(2), units=["b"])

    class Empty(nnx.Module):
        def __init__(self):
            self.drop = nnx.Dropout(0.1)
            self.lin = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    with pytest.raises(ValueError, match="unit 'drop' holds no parameter"):
        FullyShardedDataParallel(Empty(), OPT, group=group(2), units=["drop"])


@pytest.mark.parametrize("kwargs, error, match", [
    ({"zero_stage": 4}, ValueError, r"zero_stage=4 is not a ZeRO stage it runs; pass "
     r"zero_stage= one of 1 \(the optimizer state\), 2"),
    ({"zero_stage": 0}, ValueError, r"zero_stage=0 .*Stage 0 .* DistributedDataParallel's"),
    ({"stage": True}, ValueError, "stage=True is not a ZeRO stage"),
    ({"level": "p_g"}, ValueError, r"level='p_g' is not one of Paddle's levels"),
    ({"zero_stage": 2, "stage": 2}, ValueError, "pass zero_stage= only, not zero_stage= and "
     "stage="),
    ({"zero_stage": 2, "reshard_after_forward": False}, ValueError,
     "reshard_after_forward=False contradicts zero_stage=2"),
    ({"reshard_after_forward": 2}, TypeError, "reshard_after_forward=2 must be a bool"),
    ({"mp_policy": "bf16"}, TypeError, "mp_policy must be a MixedPrecisionPolicy"),
    ({"group": "world"}, TypeError, "group= takes a ProcessGroup, a 1-D DeviceMesh"),
])
def test_contradicting_or_bad_options(world, kwargs, error, match):
    with pytest.raises(error, match=match):
        FullyShardedDataParallel(Net(0), OPT, **kwargs)


def test_bad_groups_and_optimizers(world):
    with pytest.raises(TypeError, match="optax.GradientTransformation"):
        FullyShardedDataParallel(Net(0), optax.adam)
    hcg = jaxpg.HybridCommunicateGroup(dp_degree=2, pp_degree=2, sharding_degree=2)
    with pytest.raises(ValueError, match=r"\{'pp': 2\}.*jaxpg.pipeline.zero"):
        FullyShardedDataParallel(Net(0), OPT, group=hcg)
    mesh = jaxpg.init_device_mesh((2, 2, 2), ("a", "b", "c"))
    with pytest.raises(ValueError, match="has 3 dimensions"):
        FullyShardedDataParallel(Net(0), OPT, group=mesh)
    # a 1-D sub-mesh is its dimension's group, as for every group= (docs/mesh.md)
    assert FullyShardedDataParallel(Net(0), OPT, group=mesh["a"]).group.process_group \
        is mesh.get_group("a")
    with pytest.raises(ValueError, match="sharding_degree=0 must be an int >= 1"):
        jaxpg.HybridCommunicateGroup(dp_degree=8, sharding_degree=0)


def test_units_called_with_nnx_objects_are_refused(world):
    class Outer(nnx.Module):
        def __init__(self):
            self.unit = CallsWithRngs()

        def __call__(self, x):
            return self.unit(x, nnx.Rngs(0))

    class CallsWithRngs(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(7, 5, rngs=nnx.Rngs(0))

        def __call__(self, x, rngs):
            return self.lin(x)

    def loss(model, batch):
        return model(batch["x"]).mean()

    fsdp = FullyShardedDataParallel(Outer(), OPT, group=group(2), units=["unit"])
    with pytest.raises(TypeError, match="unit 'unit' was called with an NNX object \\(Rngs\\)"):
        fsdp.train_step(loss, make_batches(1, 4)[0])


def test_mixed_precision_policy():
    policy = MixedPrecisionPolicy(param_dtype=jnp.bfloat16)
    assert policy.reduce_dtype_for(jnp.float32) == jnp.bfloat16  # torch: reduce in param_dtype
    assert policy.compute_dtype_for(jnp.int32) == jnp.int32  # integers are never cast
    assert MixedPrecisionPolicy().reduce_dtype_for(jnp.float32) == jnp.float32
    x = {"f": jnp.ones(2), "i": jnp.ones(2, jnp.int32)}
    cast = policy.cast_inputs(x)
    assert cast["f"].dtype == jnp.bfloat16 and cast["i"].dtype == jnp.int32
    assert MixedPrecisionPolicy(jnp.bfloat16, cast_forward_inputs=False).cast_inputs(x) is x
    with pytest.raises(ValueError, match="param_dtype=int32 must be a floating-point"):
        MixedPrecisionPolicy(param_dtype=jnp.int32)
    with pytest.raises(TypeError, match="cast_forward_inputs='yes' must be a bool"):
        MixedPrecisionPolicy(cast_forward_inputs="yes")


@pytest.mark.parametrize("n", [1, 2, 3, 8, 12, 64])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gradient_divide_factors_are_torchs(n, dtype):
    torch = import_or_skip("torch", "torch is the reference for FSDP2's factors")
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        _get_gradient_divide_factors,
    )

    class Group:
        def size(self):
            return n

    pre, post, _, _ = _get_gradient_divide_factors(Group(), None, getattr(torch, dtype))
    if pre is None and post is None and n > 1:  # NCCL's AVG: one division after the sum
        post = n
    norm = lambda f: None if f in (None, 1) else f  # dividing by 1 is no division
    assert tuple(map(norm, divide_factors(n, np.dtype(jnp.dtype(dtype))))) == (norm(pre),
                                                                             norm(post))
