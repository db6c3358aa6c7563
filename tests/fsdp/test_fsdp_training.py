"""FullyShardedDataParallel in one process over simulated devices, against one-device
references (and DDP where module state is involved)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _fsdp_models import Block, Net, Reference, assert_trees_close, group, loss_fn, make_batches
from flax import linen, nnx

import jaxpg
from jaxpg.ddp import DistributedDataParallel
from jaxpg.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy

N, STEPS = 4, 3
BF16 = MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
# SGD with momentum: its update is linear in the gradient, so a gradient average off by a
# factor (a rank or a replica left out) moves the parameters by that factor; Adam's would
# hardly change. The momentum is optimizer state, which FSDP shards.
SGD = optax.sgd(0.5, momentum=0.9)


@pytest.fixture(scope="module")
def one_device_params():
    """Plain jax + optax on one device: STEPS SGD steps on the whole batch (computed once)."""
    ref = Reference(Net(0), SGD)
    for batch in make_batches(STEPS, 4 * N):
        ref.step(batch)
    return jax.tree.map(np.asarray, ref.params)


@pytest.mark.parametrize("stage, reshard", [(1, True), (2, True), (3, True), (3, False)])
@pytest.mark.parametrize("policy", [None, BF16], ids=["fp32", "bf16"])
def test_stages_give_one_device_parameters(world, one_device_params, stage, reshard, policy):
    fsdp = FullyShardedDataParallel(Net(0), SGD, group=group(N), zero_stage=stage,
                                    reshard_after_forward=reshard, units=Block,
                                    mp_policy=policy)
    assert fsdp.units == ("blocks.0", "blocks.1")
    for batch in make_batches(STEPS, 4 * N):
        metrics = fsdp.train_step(loss_fn, batch)
    assert np.isfinite(float(metrics["loss"]))
    if policy is None:
        want = one_device_params
    else:  # the same policy on one device: per-rank bf16 gradients averaged in float32
        ref = Reference(Net(0), SGD, policy=policy, n=N)
        for batch in make_batches(STEPS, 4 * N):
            ref.step(batch)
        want = ref.params
    assert_trees_close(fsdp.full_params(), want)
    # what each rank stores: stage 3 a 1/N shard of every parameter, else whole ones
    kernel = fsdp.params["embed"]["kernel"]
    assert kernel.shape == ((8, 12) if stage == 3 else (7, 12))
    assert kernel.addressable_shards[0].data.shape == ((2, 12) if stage == 3 else (7, 12))
    mu = fsdp.opt_state[0].trace["embed"]["kernel"]
    assert mu.shape == (8, 12) and mu.addressable_shards[0].data.shape == (2, 12)
    assert fsdp.params["scale"].shape == ()  # scalars stay replicated


@pytest.mark.parametrize("make_group, stage", [("mesh", 3), ("hcg", 3), ("mesh", 2),
                                               ("mesh", 1)])
def test_hsdp_replicates_over_one_axis_and_shards_over_the_other(world, make_group, stage):
    """HSDP trains as one device on the whole batch, with SGD: gradients averaged over the
    shards only (the replicas left out) would be twice too large and fail it."""
    if make_group == "mesh":
        g = jaxpg.init_device_mesh((2, 4), ("replicate", "shard"))
    else:
        g = jaxpg.HybridCommunicateGroup(dp_degree=2, sharding_degree=4)
        assert g.sharding_degree == 4 and g.get_sharding_parallel_world_size() == 4
        with jaxpg.as_rank(5):
            assert g.get_sharding_parallel_group().ranks == (4, 5, 6, 7)
            assert g.get_sharding_parallel_rank() == 1 and g.get_data_parallel_rank() == 1
    fsdp = FullyShardedDataParallel(Net(0), SGD, group=g, units=Block, zero_stage=stage)
    assert fsdp.group.num_shards == 4 and fsdp.group.num_replicas == 2
    ref = Reference(Net(0), SGD)
    for batch in make_batches(STEPS, 16):
        fsdp.train_step(loss_fn, batch)
        ref.step(batch)
    assert_trees_close(fsdp.full_params(), ref.params)
    assert not np.allclose(np.asarray(ref.params["head"]["kernel"][...]),
                           np.asarray(Net(0).head.kernel[...]), atol=1e-2)  # it moved
    stored = (2, 12) if stage == 3 else (7, 12)
    assert fsdp.params["embed"]["kernel"].addressable_shards[0].data.shape == stored


@pytest.mark.parametrize("stage", [1, 3])
def test_no_sync_accumulates_local_gradients(world, stage):
    opt = optax.sgd(0.1, momentum=0.9)
    fsdp = FullyShardedDataParallel(Net(0), opt, group=group(N), zero_stage=stage, units=Block)
    ref = Reference(Net(0), opt)
    batches = make_batches(3, 4 * N)
    with fsdp.no_sync():
        fsdp.train_step(loss_fn, batches[0])
        fsdp.train_step(loss_fn, batches[1])
    with pytest.raises(RuntimeError, match="pending"):
        fsdp.state_dict()
    fsdp.train_step(loss_fn, batches[2])
    assert fsdp.step == 1
    summed = jax.tree.map(lambda *g: sum(g), *(ref.grads(ref.params, b) for b in batches))
    updates, _ = opt.update(summed, ref.opt_state, ref.params)
    assert_trees_close(fsdp.full_params(), optax.apply_updates(ref.params, updates))


def test_whole_tree_transforms_equal_the_unsharded_update(world):
    # clip_by_global_norm reads every shard: its norm is an all-reduce of the shards'
    # sums of squares, so the sharded update equals the one-device one
    opt = optax.chain(optax.clip_by_global_norm(0.5), optax.add_decayed_weights(0.1), SGD)
    fsdp = FullyShardedDataParallel(Net(0), opt, group=group(8), units=["blocks.*"])
    ref = Reference(Net(0), opt)
    for batch in make_batches(STEPS, 16):
        fsdp.train_step(loss_fn, batch)
        ref.step(batch)
    assert_trees_close(fsdp.full_params(), ref.params)


def test_linen_parameter_pytree(world):
    class Mlp(linen.Module):
        @linen.compact
        def __call__(self, x):
            return linen.Dense(5)(jax.nn.relu(linen.Dense(12)(x)))

    net = Mlp()
    params = net.init(jax.random.key(0), jnp.zeros((1, 7)))["params"]

    def linen_loss(p, batch):
        logits = net.apply({"params": p}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    opt = SGD
    fsdp = FullyShardedDataParallel(params, opt, group=group(N))
    ref_params, ref_state = params, opt.init(params)
    for batch in make_batches(STEPS, 4 * N):
        fsdp.train_step(linen_loss, batch)
        updates, ref_state = opt.update(jax.grad(linen_loss)(ref_params, batch), ref_state,
                                        ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
    assert_trees_close(fsdp.full_params(), ref_params)
    with pytest.raises(TypeError, match="parameter pytree"):
        fsdp.module  # noqa: B018
    with pytest.raises(TypeError, match="needs an nnx.Module"):
        FullyShardedDataParallel(params, opt, group=group(N), units=["Dense_0"])


def test_module_and_state_dict_round_trip(world):
    opt = SGD
    batches = make_batches(4, 16)
    fsdp = FullyShardedDataParallel(Net(0), opt, group=group(N), units=Block)
    ref = Reference(Net(0), opt)
    for batch in batches[:2]:
        fsdp.train_step(loss_fn, batch)
        ref.step(batch)
    model = fsdp.module  # whole parameters, the original classes
    assert type(model.blocks[0]) is Block and model.embed.kernel.shape == (7, 12)
    x = jnp.asarray(batches[0]["x"])
    np.testing.assert_allclose(model(x), nnx.merge(ref.graphdef, ref.params)(x), atol=1e-5)
    # the sharded state into an FSDP over 8 ranks (other padding); the whole state into
    # stage 1 over 2 ranks; both hold the same training state
    other = FullyShardedDataParallel(Net(1), opt, group=group(8), units=Block)
    other.load_state_dict(fsdp.state_dict())
    whole = FullyShardedDataParallel(Net(1), opt, group=group(2), zero_stage=1)
    whole.load_state_dict(fsdp.full_state_dict())
    want = fsdp.full_state_dict()
    for f in (other, whole):
        assert f.step == 2
        got = f.full_state_dict()
        assert_trees_close(got["params"], want["params"], rtol=0, atol=0)
        assert_trees_close(got["opt_state"], want["opt_state"], rtol=0, atol=0)
    for batch in batches[2:]:  # and it trains on from there
        other.train_step(loss_fn, batch)
        ref.step(batch)
    assert_trees_close(other.full_params(), ref.params)
    bad = dict(fsdp.state_dict(), params={"embed": fsdp.params["embed"]})
    with pytest.raises(ValueError, match="first difference"):
        other.load_state_dict(bad)


def _deep(depth):
    class Wide(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(256, 256, rngs=rngs)

        def __call__(self, x):
            return x + jnp.tanh(self.a(x))

    class Stack(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0)
            self.blocks = nnx.List([Wide(rngs) for _ in range(depth)])

        def __call__(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    return nnx.eval_shape(Stack), Wide


def test_reshard_after_forward_frees_each_unit(world):
    from jaxpg.fsdp.memory import step_memory

    def mse(model, batch):
        return jnp.mean(model(batch["x"]) ** 2)

    batch = {"x": jax.ShapeDtypeStruct((8, 256), jnp.float32)}
    unit = (256 * 256 + 256) * 4
    temp = {}
    for depth, reshard in ((2, True), (6, True), (6, False)):
        model, wide = _deep(depth)
        fsdp = FullyShardedDataParallel(model, optax.adam(1e-3), group=group(N), units=wide,
                                        reshard_after_forward=reshard)
        with pytest.raises(RuntimeError, match="abstract model"):
            fsdp.train_step(mse, batch)
        mem = step_memory(fsdp, mse, batch)
        temp[depth, reshard] = mem.temp
        assert mem.params == depth * unit // N  # a 1/N shard of every parameter
    # four more blocks add their activations, not their parameters
    assert temp[6, True] - temp[2, True] < unit
    # kept from forward to backward, the gathered units the backward reads are live at once
    assert temp[6, False] - temp[6, True] > 2 * unit


class Noisy(nnx.Module):
    """A unit with module state: BatchNorm statistics and a dropout RNG stream."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(7, 7, rngs=rngs)
        self.bn = nnx.BatchNorm(7, momentum=0.5, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.bn(self.lin(x)))


class NoisyNet(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0, dropout=1)
        self.unit = Noisy(rngs)
        self.head = nnx.Linear(7, 5, rngs=rngs)

    def __call__(self, x):
        return self.head(self.unit(x))


def test_module_state_inside_units_matches_ddp(world):
    opt = SGD
    fsdp = FullyShardedDataParallel(NoisyNet(), opt, group=group(N), units=["unit"])
    ddp = DistributedDataParallel(NoisyNet(), opt, group=group(N))
    for batch in make_batches(STEPS, 4 * N):
        fsdp.train_step(loss_fn, batch)
        ddp.train_step(loss_fn, batch)
    assert_trees_close(fsdp.full_params(), ddp.params)
    assert_trees_close(fsdp.rest["unit"]["bn"], ddp.rest["unit"]["bn"])  # rank 0's statistics
    for d in (fsdp, ddp):
        assert int(d.rest["unit"]["drop"]["rngs"]["count"][...]) == STEPS
