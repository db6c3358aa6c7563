"""torch's plan API on NNX modules: a transformer block (with and without sequence
parallelism) against the unsharded block, collective counts, plan keys, embeddings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tp_models import Block, TitanBlock, block_plan, max_diff, spmd_grad, titan_plan
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.internal import collective_bytes, collective_counts
from jaxpg.tensor_parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
    parallel_style_of,
    parallelize_module,
    param_specs,
)

RNG = np.random.default_rng(1)
X = RNG.normal(size=(2, 8, 16)).astype(np.float32)


def _grads(model, mesh, sp: bool):
    """Loss, state gradients and input gradient in SPMD code, and the compiled step."""
    graphdef, state = nnx.split(model)

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x) ** 2)

    fn = spmd_grad(loss, mesh, param_specs(state), P(None, "tp") if sp else P(),
                   reduce_loss=sp)
    return fn(state, X), fn.lower(state, X).compile()


def _reference(model):
    graphdef, state = nnx.split(model)
    return jax.value_and_grad(lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x) ** 2),
                              argnums=(0, 1))(state, X)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_block_matches_the_unsharded_block(mesh, sp):
    want, (want_g, want_gx) = _reference(Block(16, 4, nnx.Rngs(0)))
    block = parallelize_module(Block(16, 4, nnx.Rngs(0)), mesh["tp"], block_plan(sp))
    (got, (g, gx)), compiled = _grads(block, mesh, sp)
    assert abs(float(got) - float(want)) < 1e-5 * float(want)
    assert max_diff(nnx.to_pure_dict(g), nnx.to_pure_dict(want_g)) < 1e-4
    assert max_diff(gx, want_gx) < 1e-4
    counts = collective_counts(compiled)
    if sp:  # Megatron SP: 2 all-gathers + 2 reduce-scatters forward, as many backward,
        # and one all-reduce of the LayerNorm gradients (combined with the loss's by XLA)
        assert (counts["all-gather"], counts["reduce-scatter"]) == (4, 4)
        assert counts["all-reduce"] <= 2
    else:  # Megatron: 2 all-reduces forward (g), 2 backward (f)
        assert counts == {**dict.fromkeys(counts, 0), "all-reduce": 4}
    host = block(X)  # host code: global arrays, XLA partitions the unsharded computation
    assert max_diff(host, nnx.merge(*nnx.split(Block(16, 4, nnx.Rngs(0))))(X)) < 1e-5


# one tp degree suffices for the plain count; tp=4 runs with sp
@pytest.mark.parametrize("mesh, sp", [(2, False), (2, True), (4, True)], indirect=["mesh"],
                         ids=["tp2", "tp2-sp", "tp4-sp"])
def test_prepare_module_input_shares_one_gradient_reduction(mesh, sp):
    want, (want_g, want_gx) = _reference(TitanBlock(16, 4, nnx.Rngs(2)))
    block = parallelize_module(TitanBlock(16, 4, nnx.Rngs(2)), mesh["tp"], titan_plan(sp))
    (got, (g, gx)), compiled = _grads(block, mesh, sp)
    assert abs(float(got) - float(want)) < 1e-5 * float(want)
    assert max_diff(nnx.to_pure_dict(g), nnx.to_pure_dict(want_g)) < 1e-4
    assert max_diff(gx, want_gx) < 1e-4
    counts = collective_counts(compiled)
    if sp:  # one all-gather in front of wq/wk/wv, one reduce-scatter for their gradients
        assert (counts["all-gather"], counts["reduce-scatter"]) == (2, 2)
    else:  # wo's all-reduce forward; one all-reduce for the three input gradients
        activation = X.size * 4
        assert collective_bytes(compiled)["all-reduce"] == 2 * activation
        plan = {k: v for k, v in titan_plan(False).items() if k != "attention"}
        alone = parallelize_module(TitanBlock(16, 4, nnx.Rngs(2)), mesh["tp"], plan)
        # each ColwiseParallel alone: one all-reduce each (XLA may combine them into one
        # instruction, but the bytes are three gradients')
        assert collective_bytes(_grads(alone, mesh, False)[1])["all-reduce"] == 4 * activation


class Stack(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.blocks = nnx.List([Mlp(rngs) for _ in range(2)])

    def __call__(self, x):
        for b in self.blocks:
            x = x + b(self.norm(x))
        return x


class Mlp(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(8, 16, rngs=rngs)
        self.down = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def test_plan_keys_match_paths_with_wildcards_and_change_the_module_in_place(mesh):
    model = Stack(nnx.Rngs(0))
    before = jax.tree.map(np.asarray, nnx.state(model))
    want = model(X[..., :8])
    up = model.blocks[1].up
    out = parallelize_module(model, mesh["tp"], {"blocks.*.up": ColwiseParallel(),
                                                 "blocks.*.down": RowwiseParallel()})
    assert out is model and model.blocks[1].up is up and isinstance(up, nnx.Linear)
    assert isinstance(parallel_style_of(up)[0], ColwiseParallel)
    assert parallel_style_of(model.norm) is None
    after = nnx.state(model)
    assert max_diff(before, after) == 0.0  # the module keeps its full weights
    assert up.kernel[...].sharding.spec == P(None, "tp")
    assert model.blocks[0].down.kernel[...].sharding.spec == P("tp", None)
    assert model.blocks[0].down.bias[...].sharding.spec == P()
    assert model.norm.scale[...].sharding == NamedSharding(mesh.jax_mesh, P())  # the rest
    local = up.kernel[...].addressable_shards[0].data
    assert local.shape == (8, 16 // mesh.size("tp"))
    assert max_diff(model(X[..., :8]), want) < 1e-5


# rowwise runs at tp=4 as rowwise_sp
@pytest.mark.parametrize("mesh, style", [(2, "colwise"), (2, "rowwise"), (2, "rowwise_sp"),
                                         (4, "colwise"), (4, "rowwise_sp")], indirect=["mesh"])
def test_embedding_styles_match_nnx_embed(mesh, style):
    styles = {"colwise": ColwiseParallel(output_layouts=Replicate()),
              "rowwise": RowwiseParallel(input_layouts=Replicate()),
              "rowwise_sp": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))}
    ids = RNG.integers(0, 32, (2, 8)).astype(np.int32)
    ref = nnx.Embed(32, 16, rngs=nnx.Rngs(4))
    weights = jax.random.normal(jax.random.key(1), (2, 8, 16))
    want, want_g = jax.value_and_grad(lambda t: jnp.sum(jnp.take(t, ids, 0) * weights))(
        ref.embedding[...])
    emb = parallelize_module(nnx.Embed(32, 16, rngs=nnx.Rngs(4)), mesh["tp"], styles[style])
    graphdef, state = nnx.split(emb)
    out_spec = P(None, "tp") if style == "rowwise_sp" else P()

    def body(state, ids, w):
        f = lambda s: jnp.sum(nnx.merge(graphdef, s)(ids) * w)  # noqa: E731
        loss, g = jax.value_and_grad(f)(state)
        return (jax.lax.psum(loss, "tp") if style == "rowwise_sp" else loss), g

    specs = param_specs(state)
    fn = jax.jit(jax.shard_map(body, mesh=mesh.jax_mesh, in_specs=(specs, P(), out_spec),
                               out_specs=(P(), specs), check_vma=False))
    got, g = fn(state, ids, weights)
    assert abs(float(got) - float(want)) < 1e-4
    assert max_diff(g["embedding"][...], want_g) < 1e-5
    host = emb(ids)
    assert max_diff(host, jnp.take(ref.embedding[...], ids, 0)) < 1e-6
    assert host.sharding.spec == (P(None, "tp") if style == "rowwise_sp" else P())


def test_host_code_outputs_follow_their_layouts(mesh):
    tp = mesh["tp"]
    ref = nnx.Linear(16, 16, rngs=nnx.Rngs(5))
    want = ref(X)
    glob = parallelize_module(nnx.Linear(16, 16, rngs=nnx.Rngs(5)), tp,
                              ColwiseParallel(use_local_output=False))
    out = glob(X)  # a global array: JAX's DTensor, split on the last dimension
    assert out.sharding.spec == P(None, None, "tp") and max_diff(out, want) < 1e-6
    norm = parallelize_module(nnx.LayerNorm(16, rngs=nnx.Rngs(5)), tp, SequenceParallel())
    out = norm(X)
    assert out.sharding.spec == P(None, "tp")
    back = parallelize_module(nnx.LayerNorm(16, rngs=nnx.Rngs(5)), tp, PrepareModuleOutput(
        output_layouts=Shard(1), desired_output_layouts=Replicate()))
    assert back(X).sharding.spec == P()
    assert max_diff(back(X), nnx.LayerNorm(16, rngs=nnx.Rngs(5))(X)) < 1e-5


def test_attach_plan_sets_the_styles_and_returns_the_specs_without_touching_arrays(mesh):
    # an abstract block (nnx.eval_shape): the styles and their specs, the arrays left abstract
    from jaxpg.tensor_parallel import attach_plan

    block = nnx.eval_shape(lambda: Block(16, 4, nnx.Rngs(0)))
    specs = attach_plan(block, mesh["tp"], block_plan(False))
    assert specs == {"qkv.kernel": P(None, "tp"), "qkv.bias": P("tp"),
                     "proj.kernel": P("tp", None), "up.kernel": P(None, "tp"),
                     "up.bias": P("tp"), "down.kernel": P("tp", None)}
    assert isinstance(parallel_style_of(block.up)[0], ColwiseParallel)
    assert isinstance(block.qkv.kernel.get_value(), jax.ShapeDtypeStruct)
    with pytest.raises(ValueError, match="already parallelized"):
        attach_plan(block, mesh["tp"], {"up": ColwiseParallel()})
