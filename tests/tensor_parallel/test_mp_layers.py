"""Paddle's mp layers against the unsharded flax layers: initial values, outputs, gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tp_models import max_diff, spmd_grad
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpg.tensor_parallel import (
    ColumnParallelLinear,
    ColumnSequenceParallelLinear,
    ParallelCrossEntropy,
    RowParallelLinear,
    RowSequenceParallelLinear,
    SequenceParallel,
    VocabParallelEmbedding,
    parallelize_module,
    param_specs,
)

RNG = np.random.default_rng(0)


def _tp_coord(mesh, device) -> int:
    where = np.argwhere(np.asarray(mesh.jax_mesh.devices) == device)[0]
    return int(where[mesh.mesh_dim_names.index("tp")])


def test_each_device_holds_its_slice_of_the_unsharded_layer(mesh):
    g, n = mesh["tp"], mesh.size("tp")
    col = ColumnParallelLinear(8, 16, has_bias=True, gather_output=False, mp_group=g,
                               rngs=nnx.Rngs(3))
    row = RowParallelLinear(16, 8, mp_group=g, rngs=nnx.Rngs(4))
    emb = VocabParallelEmbedding(32, 8, mp_group=g, rngs=nnx.Rngs(5))
    col_ref, row_ref = nnx.Linear(8, 16, rngs=nnx.Rngs(3)), nnx.Linear(16, 8, rngs=nnx.Rngs(4))
    emb_ref = nnx.Embed(32, 8, rngs=nnx.Rngs(5))
    cases = [(col.weight, col_ref.kernel, 1), (col.bias, col_ref.bias, 0),
             (row.weight, row_ref.kernel, 0), (row.bias, row_ref.bias, None),
             (emb.weight, emb_ref.embedding, 0)]
    for param, ref, axis in cases:
        full = np.asarray(ref[...])
        shards = param[...].addressable_shards
        assert len(shards) == 8
        for shard in shards:
            want = full if axis is None else np.split(full, n, axis=axis)[
                _tp_coord(mesh, shard.device)]
            np.testing.assert_array_equal(np.asarray(shard.data), want)
    assert col.output_size_per_partition == 16 // n and row.input_size_per_partition == 16 // n
    assert emb.per_part_size == 32 // n and emb.vocab_start_index == 0


class PaddleMLP(nnx.Module):
    """Column -> gelu -> Row, as Paddle's examples build it."""

    def __init__(self, group, gathered: bool, seed: int):
        self.a = ColumnParallelLinear(8, 16, has_bias=True, gather_output=gathered,
                                      mp_group=group, rngs=nnx.Rngs(seed))
        self.b = RowParallelLinear(16, 8, input_is_parallel=not gathered, mp_group=group,
                                   rngs=nnx.Rngs(seed + 1))

    def __call__(self, x):
        return self.b(jax.nn.gelu(self.a(x)))


class RefMLP(nnx.Module):
    def __init__(self, seed: int):
        self.a = nnx.Linear(8, 16, rngs=nnx.Rngs(seed))
        self.b = nnx.Linear(16, 8, rngs=nnx.Rngs(seed + 1))

    def __call__(self, x):
        return self.b(jax.nn.gelu(self.a(x)))


def _paddle_names(tree):
    """The reference's gradients under the Paddle layers' names (kernel -> weight)."""
    return {k: {("weight" if n == "kernel" else n): v for n, v in sub.items()}
            for k, sub in tree.items()}


@pytest.mark.parametrize("gathered", [False, True], ids=["split", "gathered"])
def test_column_and_row_parallel_linear_match_unsharded(mesh, gathered):
    model, ref = PaddleMLP(mesh["tp"], gathered, 7), RefMLP(7)
    x = RNG.normal(size=(4, 3, 8)).astype(np.float32)
    graphdef, state = nnx.split(model)
    ref_graph, ref_state = nnx.split(ref)

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x) ** 2)

    want_loss, (want_g, want_gx) = jax.value_and_grad(
        lambda s, x: jnp.sum(nnx.merge(ref_graph, s)(x) ** 2), argnums=(0, 1))(ref_state, x)
    want_g = _paddle_names(nnx.to_pure_dict(want_g))
    # SPMD code: local shards, Megatron's collectives
    got_loss, (g, gx) = spmd_grad(loss, mesh, param_specs(state), P())(state, x)
    assert abs(float(got_loss) - float(want_loss)) < 1e-4 * abs(float(want_loss))
    assert max_diff(nnx.to_pure_dict(g), want_g) < 1e-4
    assert max_diff(gx, want_gx) < 1e-4
    # host code: global arrays
    host_loss, (hg, hgx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, x)
    assert abs(float(host_loss) - float(want_loss)) < 1e-4 * abs(float(want_loss))
    assert max_diff(nnx.to_pure_dict(hg), want_g) < 1e-4 and max_diff(hgx, want_gx) < 1e-4
    out = model.a(x)
    assert out.shape == (4, 3, 16)  # a global array (this one process holds every rank)
    assert out.sharding.spec == (P() if gathered else P(None, None, "tp"))


class LossModel(nnx.Module):
    """VocabParallelEmbedding -> ColumnParallelLinear (vocab-parallel logits) -> CE."""

    def __init__(self, group, vocab: int, dim: int):
        self.emb = VocabParallelEmbedding(vocab, dim, mp_group=group, rngs=nnx.Rngs(1))
        self.head = ColumnParallelLinear(dim, vocab, has_bias=True, gather_output=False,
                                         mp_group=group, rngs=nnx.Rngs(2))
        self.ce = ParallelCrossEntropy(mp_group=group, ignore_index=-100)

    def __call__(self, ids, labels):
        per_token = self.ce(self.head(jnp.tanh(self.emb(ids))), labels)
        assert per_token.shape == labels.shape + (1,)  # Paddle's trailing 1
        return jnp.sum(per_token) / jnp.sum(labels != -100)


def test_vocab_parallel_embedding_and_cross_entropy_with_ignore_index(mesh):
    vocab, dim = 32, 8
    model = LossModel(mesh["tp"], vocab, dim)
    emb, head = nnx.Embed(vocab, dim, rngs=nnx.Rngs(1)), nnx.Linear(dim, vocab, rngs=nnx.Rngs(2))
    ids = RNG.integers(0, vocab, (4, 6)).astype(np.int32)
    labels = RNG.integers(0, vocab, (4, 6)).astype(np.int32)
    labels[0, :3] = labels[2, 5] = -100  # ignored tokens

    def ref_loss(weights):
        logits = jnp.tanh(jnp.take(weights["emb"], ids, axis=0)) @ weights["kernel"] + weights[
            "bias"]
        keep = labels != -100
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, np.where(keep, labels, 0))
        return jnp.sum(jnp.where(keep, ce, 0.0)) / keep.sum()

    weights = {"emb": emb.embedding[...], "kernel": head.kernel[...], "bias": head.bias[...]}
    want, want_g = jax.value_and_grad(ref_loss)(weights)
    graphdef, state = nnx.split(model)

    def loss(state, ids):
        return nnx.merge(graphdef, state)(ids, jnp.asarray(labels))

    def check(got, g):
        g = nnx.to_pure_dict(g)
        assert abs(float(got) - float(want)) < 1e-5
        assert max_diff(g["emb"]["weight"], want_g["emb"]) < 1e-5
        assert max_diff(g["head"]["weight"], want_g["kernel"]) < 1e-5
        assert max_diff(g["head"]["bias"], want_g["bias"]) < 1e-5

    specs = param_specs(state)
    fn = jax.jit(jax.shard_map(lambda s, i: jax.value_and_grad(loss)(s, i), mesh=mesh.jax_mesh,
                               in_specs=(specs, P()), out_specs=(P(), specs), check_vma=False))
    check(*fn(state, ids))
    check(*jax.jit(jax.value_and_grad(loss))(state, ids))  # host code
    ignored = np.asarray(model.ce(model.head(jnp.tanh(model.emb(ids))), labels[..., None]))
    assert np.all(ignored[labels == -100] == 0) and np.all(ignored[labels != -100] > 0)


class SeqParallelMLP(nnx.Module):
    """Paddle's sequence parallelism, sequence-first [s, b, h]: LN on the sequence chunk,
    ColumnSequenceParallelLinear -> gelu -> RowSequenceParallelLinear, residual."""

    def __init__(self, group, seed: int):
        self.ln = nnx.LayerNorm(8, rngs=nnx.Rngs(seed))
        self.a = ColumnSequenceParallelLinear(8, 16, has_bias=True, mp_group=group,
                                              rngs=nnx.Rngs(seed))
        self.b = RowSequenceParallelLinear(16, 8, mp_group=group, rngs=nnx.Rngs(seed + 1))

    def __call__(self, x):
        return x + self.b(jax.nn.gelu(self.a(self.ln(x))))


class RefSeqMLP(nnx.Module):
    def __init__(self, seed: int):
        self.ln = nnx.LayerNorm(8, rngs=nnx.Rngs(seed))
        self.a = nnx.Linear(8, 16, rngs=nnx.Rngs(seed))
        self.b = nnx.Linear(16, 8, rngs=nnx.Rngs(seed + 1))

    def __call__(self, x):
        return x + self.b(jax.nn.gelu(self.a(self.ln(x))))


def test_sequence_parallel_linears_match_unsharded(mesh):
    model = SeqParallelMLP(mesh["tp"], 3)
    parallelize_module(model, mesh["tp"], {"ln": SequenceParallel(sequence_dim=0)})
    ref_graph, ref_state = nnx.split(RefSeqMLP(3))
    x = RNG.normal(size=(8, 2, 8)).astype(np.float32)  # [s, b, h]
    graphdef, state = nnx.split(model)

    def loss(state, x):  # this rank's tokens only: the caller sums over the group
        return jnp.sum(nnx.merge(graphdef, state)(x) ** 2)

    want, (wg, wgx) = jax.value_and_grad(
        lambda s, x: jnp.sum(nnx.merge(ref_graph, s)(x) ** 2), argnums=(0, 1))(ref_state, x)
    got, (g, gx) = spmd_grad(loss, mesh, param_specs(state), P("tp"), reduce_loss=True)(state, x)
    assert abs(float(got) - float(want)) < 1e-4 * float(want)
    assert max_diff(nnx.to_pure_dict(g), _paddle_names(nnx.to_pure_dict(wg))) < 1e-4
    assert max_diff(gx, wgx) < 1e-4
