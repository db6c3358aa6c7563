"""A parallelized model trains through DistributedDataParallel on a ("dp", "tp") mesh and
matches one-device training on the whole batch (the pipeline's composition, DP x PP x TP,
is checked by examples/gpt_hybrid.py and tests/tensor_parallel/test_gpt_hybrid.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tp_models import Block, block_plan, max_diff
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpg.ddp import DistributedDataParallel
from jaxpg.tensor_parallel import PrepareModuleInputOutput, Replicate, Shard, parallelize_module

STEPS = 3


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


# tp=2 runs plain tensor parallelism, tp=4 sequence parallelism (one compile each)
@pytest.mark.parametrize("mesh, sp", [(2, False), (4, True)], indirect=["mesh"],
                         ids=["tp2", "tp4-sp"])
def test_ddp_on_a_dp_tp_mesh_matches_one_device_training(mesh, sp):
    optimizer = optax.sgd(0.05, momentum=0.9)
    model = Block(16, 4, nnx.Rngs(0))
    if sp:  # the block takes and returns whole sequences; inside, they are split
        parallelize_module(model, mesh["tp"], PrepareModuleInputOutput(
            input_layouts=Replicate(), desired_input_layouts=Shard(1),
            output_layouts=Shard(1), desired_output_layouts=Replicate()))
    parallelize_module(model, mesh["tp"], block_plan(sp))
    ddp = DistributedDataParallel(model, optimizer, group=mesh.get_group("dp"))
    assert ddp.params["qkv"]["kernel"][...].sharding.spec == P(None, "tp")
    trace = ddp.opt_state[0].trace  # momentum follows its parameter's layout
    assert trace["qkv"]["kernel"][...].sharding.spec == P(None, "tp")

    ref = Block(16, 4, nnx.Rngs(0))
    graphdef, params, rest = nnx.split(ref, nnx.Param, ...)
    opt_state = optimizer.init(params)

    @jax.jit
    def ref_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), batch))(
            params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(5)
    for _ in range(STEPS):
        batch = {k: rng.normal(size=(8, 8, 16)).astype(np.float32) for k in ("x", "y")}
        got = ddp.train_step(loss_fn, batch)["loss"]
        params, opt_state, want = ref_step(params, opt_state, batch)
        assert abs(float(got) - float(want)) < 1e-5
    full = nnx.state(ddp.module, nnx.Param)  # gathered: the full, unsharded model
    assert full["qkv"]["kernel"][...].sharding.spec == P()
    assert max_diff(full, params) < 1e-5
