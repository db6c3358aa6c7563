"""ZeRO-1, 2 and 3 over dp inside pipeline stages, against the plain pipeline step."""

import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

# meshes of 2 to 8 devices: not on one GPU (tools/gpu_check.sh)
pytestmark = pytest.mark.cpu_only

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipeline"))
from test_executor import block, embed, head_loss, make_batch, make_params  # noqa: E402

import jaxpg  # noqa: E402
from jaxpg.pipeline.train_step import init_train_state, make_train_step  # noqa: E402
from jaxpg.pipeline.zero import make_zero_train_step  # noqa: E402

# SGD with momentum (sharded state, linear in the gradient) after a whole-tree clip that a
# wrong gradient scale changes only where it clips
OPT = optax.chain(optax.clip_by_global_norm(5.0), optax.sgd(0.1, momentum=0.9))


@pytest.fixture(scope="module")
def plain():
    """The plain pipeline step's parameters after 3 steps (dp=2, pp=4)."""
    mesh = jaxpg.ParallelDims(dp_replicate=2, pp=4)
    params, opt_state = init_train_state(make_params(4), OPT, mesh)
    step = make_train_step(block, head_loss, OPT, mesh=mesh, schedule="1f1b",
                           num_microbatches=4, first_fn=embed)
    x, t = make_batch(16)
    for _ in range(3):
        params, opt_state, loss = step(params, opt_state, x, t)
    return jax.tree.map(np.asarray, params), float(loss)


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_zero_inside_stages_equals_the_plain_step(plain, zero_stage):
    mesh = jaxpg.ParallelDims(dp_replicate=2, pp=4)
    # the one keyword: make_train_step(zero_stage=) and init_train_state(zero_stage=)
    params, opt_state = init_train_state(make_params(4), OPT, mesh, zero_stage=zero_stage)
    step = make_train_step(block, head_loss, OPT, mesh=mesh, zero_stage=zero_stage,
                           params=params, schedule="1f1b", num_microbatches=4, first_fn=embed)
    x, t = make_batch(16)
    for _ in range(3):
        params, opt_state, loss = step(params, opt_state, x, t)
    want, want_loss = plain
    for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    # the stage moments: [stages, 8] split over pp on dim 0 and dp on dim 1
    mu = opt_state[1][0].trace.stages["b"]
    assert mu.sharding.spec == jax.sharding.PartitionSpec("pp", "dp_replicate")
    assert mu.addressable_shards[0].data.shape == (1, 4)
    assert params.stages["b"].sharding.spec == jax.sharding.PartitionSpec("pp")


@pytest.mark.parametrize("remat", [False, True])
def test_zero3_inside_stages_equals_the_plain_step(plain, remat):
    """zero_stage=3 on dp_shard = 2 x pp = 4: every parameter split over dp_shard (the
    embedding on its second dimension, which 2 divides), gathered by each stage per
    microbatch; three steps give the plain step's parameters and loss, and the parameters
    and optimizer state stay split."""
    mesh = jaxpg.ParallelDims(dp_shard=2, pp=4)
    params, opt_state = init_train_state(make_params(4), OPT, mesh, zero_stage=3)
    step = make_train_step(block, head_loss, OPT, mesh=mesh, zero_stage=3, params=params,
                           schedule="1f1b", num_microbatches=4, first_fn=embed, remat=remat)
    x, t = make_batch(16)
    for _ in range(3):
        params, opt_state, loss = step(params, opt_state, x, t)
    want, want_loss = plain
    for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    spec = jax.sharding.PartitionSpec
    assert params.stages["w"].sharding.spec == spec("pp", "dp_shard")
    assert params.first.sharding.spec == spec(None, "dp_shard")  # (3, 8): 2 divides 8
    assert params.last.sharding.spec == spec("dp_shard")
    assert params.stages["w"].addressable_shards[0].data.shape == (1, 4, 8)
    assert opt_state[1][0].trace.stages["w"].sharding.spec == spec("pp", "dp_shard")


def test_bad_zero_options():
    mesh = jaxpg.ParallelDims(dp_replicate=2, pp=4)
    with pytest.raises(ValueError, match=r"make_zero_train_step: zero_stage=3 is not a "
                                         r"ZeRO stage it runs.*one of 1 .*, 2 .*Stages 0 .* "
                                         r"and 3 .*make_train_step\(zero_stage=\)"):
        make_zero_train_step(block, head_loss, OPT, make_params(4), mesh=mesh, zero_stage=3)
    with pytest.raises(ValueError, match=r"make_train_step: zero_stage=4 is not a ZeRO stage"):
        make_train_step(block, head_loss, OPT, mesh=mesh, zero_stage=4, params=make_params(4))
    with pytest.raises(ValueError, match="zero_stage=3 splits the parameters by their shapes; "
                                         "pass params="):
        make_train_step(block, head_loss, OPT, mesh=mesh, zero_stage=3)
    with pytest.raises(ValueError, match="zero_stage=3 runs on the lockstep executor"):
        make_train_step(block, head_loss, OPT, mesh=mesh, zero_stage=3, params=make_params(4),
                        executor="mpmd")
    with pytest.raises(ValueError, match=r"init_train_state: zero_stage=3 splits every "
                                         r"parameter .* cannot also take param_specs"):
        init_train_state(make_params(4), OPT, mesh, zero_stage=3,
                         param_specs=jax.tree.map(lambda _: jax.sharding.PartitionSpec(),
                                                  make_params(4)))
    with pytest.raises(ValueError, match="zero_stage=1 splits the optimizer state by the "
                                         "parameters' shapes; pass params="):
        make_train_step(block, head_loss, OPT, mesh=mesh, zero_stage=1)
    with pytest.raises(ValueError, match=r"init_train_state: zero_stage=1 with param_specs"):
        init_train_state(make_params(4), OPT, mesh, zero_stage=1,
                         param_specs=jax.tree.map(lambda _: jax.sharding.PartitionSpec(),
                                                  make_params(4)))
    with pytest.raises(ValueError, match="zero_stage=2 runs on the lockstep executor"):
        make_train_step(block, head_loss, OPT, mesh=mesh, zero_stage=2, params=make_params(4),
                        executor="mpmd")
    with pytest.raises(ValueError, match="needs a mesh with a pipeline axis 'pp' and a "
                                         "data-parallel axis 'data'"):
        make_zero_train_step(block, head_loss, OPT, make_params(4), mesh=mesh, dp_axis="data")
    specs = jax.tree.map(lambda _: jax.sharding.PartitionSpec(), make_params(4))
    with pytest.raises(ValueError, match=r"param_specs=.*not supported with ZeRO inside a "
                                         r"pipeline yet"):
        make_zero_train_step(block, head_loss, OPT, make_params(4), mesh=mesh,
                             param_specs=specs)
