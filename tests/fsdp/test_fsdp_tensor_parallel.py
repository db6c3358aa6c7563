"""FSDP (stages 1 to 3) and DDP's ZeRO-1 of a tensor-parallel model on a ("dp", "tp") mesh
(torchtitan's 2-D layout: parallelize first, then shard over dp), against one-device
training on the whole batch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpg
from jaxpg.ddp import DistributedDataParallel
from jaxpg.fsdp import FullyShardedDataParallel
from jaxpg.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module

STEPS = 3
PLAN = {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}


class Mlp(nnx.Module):
    """A residual MLP block: ``up`` column-parallel, ``down`` row-parallel."""

    def __init__(self, d: int, hidden: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, d, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class Net(nnx.Module):
    # d = 6 and hidden = 12 on dp = 4, tp = 2: up's kernel (6, 12) is padded to 8 rows;
    # down's (12, 6) splits into two tp blocks of 6 rows, each padded to 8
    def __init__(self, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.blocks = nnx.List([Mlp(6, 12, rngs) for _ in range(2)])
        self.head = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def batches(n):
    rng = np.random.default_rng(3)
    return [{"x": rng.normal(size=(8, 6)).astype(np.float32),
             "y": rng.normal(size=(8, 3)).astype(np.float32)} for _ in range(n)]


def reference(optimizer):
    """The unparallelized model trained on one device on the whole batch."""
    graphdef, params, rest = nnx.split(Net(), nnx.Param, ...)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for batch in batches(STEPS):
        params, opt_state = step(params, opt_state, batch)
    return params


def parallel_net(mesh):
    return parallelize_module(Net(), mesh["tp"], PLAN)


def assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6)


@pytest.fixture(scope="module")
def sgd_reference():
    return reference(optax.sgd(0.5, momentum=0.9))  # a wrong gradient scale shows


@pytest.fixture
def mesh(world):
    return jaxpg.init_device_mesh((4, 2), ("dp", "tp"))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fsdp_of_a_tensor_parallel_model_matches_one_device_training(mesh, sgd_reference,
                                                                     stage):
    fsdp = FullyShardedDataParallel(parallel_net(mesh), optax.sgd(0.5, momentum=0.9),
                                    group=mesh.get_group("dp"), zero_stage=stage, units=Mlp)
    assert fsdp.group.shard_axes == ("dp",) and fsdp.group.model_axes == ("tp",)
    up = fsdp.params["blocks"][0]["up"]["kernel"]
    down = fsdp.params["blocks"][0]["down"]["kernel"]
    if stage == 3:  # dp on top of the tp split; down's two tp blocks of 6 rows padded to 8
        assert up.sharding.spec == P("dp", "tp") and up.shape == (8, 12)
        assert down.sharding.spec == P(("tp", "dp")) and down.shape == (16, 6)
        assert down.addressable_shards[0].data.shape == (2, 6)
    else:
        assert up.sharding.spec == P(None, "tp") and up.shape == (6, 12)
    mu = fsdp.opt_state[0].trace["blocks"][1]["up"]["kernel"]
    assert mu.sharding.spec == P("dp", "tp") and mu.addressable_shards[0].data.shape == (2, 6)
    for batch in batches(STEPS):
        fsdp.train_step(loss_fn, batch)
    assert_close(fsdp.full_params(), sgd_reference)
    model = fsdp.module  # the full, unsharded model
    kernel = model.blocks[0].down.kernel[...]
    assert kernel.shape == (12, 6) and kernel.sharding.spec == P()
    if stage == 3:  # rows padded inside the array: whole-array conversions are refused
        with pytest.raises(ValueError, match="tensor-parallel blocks are padded"):
            fsdp.full_state_dict()


def test_no_sync_of_a_tensor_parallel_model(mesh):
    opt = optax.sgd(0.1)
    fsdp = FullyShardedDataParallel(parallel_net(mesh), opt, group=mesh.get_group("dp"),
                                    units=Mlp)
    graphdef, params, rest = nnx.split(Net(), nnx.Param, ...)
    grad = jax.grad(lambda p, b: loss_fn(nnx.merge(graphdef, p, rest), b))
    two = batches(2)
    with fsdp.no_sync():
        fsdp.train_step(loss_fn, two[0])
    fsdp.train_step(loss_fn, two[1])
    summed = jax.tree.map(jnp.add, grad(params, two[0]), grad(params, two[1]))
    updates, _ = opt.update(summed, opt.init(params), params)
    assert_close(fsdp.full_params(), optax.apply_updates(params, updates))


def test_ddp_shard_optimizer_state_of_a_tensor_parallel_model(mesh, sgd_reference):
    ddp = DistributedDataParallel(parallel_net(mesh), optax.sgd(0.5, momentum=0.9),
                                  group=mesh.get_group("dp"), zero_stage=1)
    mu = ddp.opt_state[0].trace["blocks"][0]
    assert mu["up"]["kernel"].sharding.spec == P("dp", "tp")
    assert mu["down"]["kernel"].sharding.spec == P(("tp", "dp"))
    assert ddp.params["blocks"][0]["down"]["kernel"].sharding.spec[0] == "tp"
    for batch in batches(STEPS):
        ddp.train_step(loss_fn, batch)
    assert_close(ddp.params, sgd_reference)


def test_groups_that_do_not_compose_with_tensor_parallelism_are_refused(mesh):
    with pytest.raises(ValueError, match=r"HSDP and hybrid groups do not compose.*"
                                         r"group=mesh.get_group\('dp'\)"):
        FullyShardedDataParallel(parallel_net(mesh), optax.sgd(0.1), group=mesh)
    with pytest.raises(ValueError, match=r"split over the data-parallel axes \['tp'\]"):
        FullyShardedDataParallel(parallel_net(mesh), optax.sgd(0.1))  # the world: dp x tp
