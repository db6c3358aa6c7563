"""Context-parallel PipelineStages in one process, on the 8 simulated devices: a
``("pp", "cp") = (2, 4)`` mesh, two unequal stages of causal self-attention through
``ContextParallelAttention`` over their 4 cp devices (ring attention, the load-balanced
layout), each device holding its part of every sequence, the position ids carried from
the first stage to the second beside the activations; their programs (the ones a schedule
runs) driven microbatch by microbatch by hand.

Losses, gradients and an SGD step must equal the un-pipelined model's with plain attention
over the whole sequence in order, on the whole batch; every parameter stays replicated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_stage_fsdp import B, check_sgd, check_step, reference, run_pipeline

import jaxpg
from jaxpg.context_parallel import ContextParallelAttention
from jaxpg.context_parallel.chunks import chunk_order
from jaxpg.pipeline import PipelineStage

V, D, HEADS, S, CP = 12, 8, 2, 16, 4  # vocabulary, width, heads, sequence, cp degree


class Attention(nnx.Module):
    """A pre-norm causal self-attention block with a residual."""

    def __init__(self, group, rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.qkv = nnx.Linear(D, 3 * D, rngs=rngs)
        self.o = nnx.Linear(D, D, rngs=rngs)
        self.attn = ContextParallelAttention(group=group, causal=True)

    def __call__(self, h):
        b, s, _ = h.shape
        q, k, v = (t.reshape(b, s, HEADS, D // HEADS)
                   for t in jnp.split(self.qkv(self.norm(h)), 3, axis=-1))
        return h + self.o(self.attn(q, k, v).reshape(b, s, D))


class EmbedAttention(nnx.Module):
    def __init__(self, group, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.pos = nnx.Embed(S, D, rngs=rngs)
        self.block = Attention(group, rngs)

    def __call__(self, tokens, positions):
        return self.block(self.embed(tokens) + self.pos(positions)), positions


class AttentionHead(nnx.Module):
    def __init__(self, group, rngs):
        self.pos = nnx.Embed(S, D, rngs=rngs)  # reads the positions the first stage carried
        self.block = Attention(group, rngs)
        self.out = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, h, positions):
        return self.out(self.block(h + self.pos(positions)))


def modules(group):
    return EmbedAttention(group, nnx.Rngs(5)), AttentionHead(group, nnx.Rngs(6))


def laid_out(x):
    """``x`` (batch, S) with its sequence in the cp ranks' order: rank ``r``'s part (the
    load-balanced chunks ``r`` and ``2 cp - 1 - r``) is the ``r``-th quarter, as the stage's
    mesh splits dimension 1."""
    chunks = np.split(np.arange(S), 2 * CP)
    return x[:, np.concatenate([chunks[c] for c in chunk_order(CP, True)])]


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_context_parallel_stages_give_the_un_pipelined_gradients(world, split):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, V, (B, S)), jnp.int32)
    labels = jnp.asarray(rng.integers(0, V, (B, S)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), tokens.shape)
    # the reference: plain attention over each whole sequence, in order
    want_losses, want_grads, want_after = reference(tokens, labels, modules(False),
                                                    (positions,))

    mesh = jaxpg.init_device_mesh((2, CP), ("pp", "cp"))
    stages = []
    for s in range(2):
        with jaxpg.as_rank(CP * s):  # stage s's cp group: devices 4s .. 4s + 3
            stages.append(PipelineStage(modules(mesh["cp"])[s], s, 2, group=mesh["pp"],
                                        context_parallel_group=mesh["cp"]))
    for s, st in enumerate(stages):
        assert [d.id for d in st.cp.mesh.devices.flat] == [CP * s + i for i in range(CP)]
        assert {a.sharding.spec for a in jax.tree.leaves(st.params())} == {P()}

    inputs = (jnp.asarray(laid_out(np.asarray(tokens))),
              jnp.asarray(laid_out(np.asarray(positions))))
    losses, grads, _ = run_pipeline(stages, inputs, jnp.asarray(laid_out(np.asarray(labels))),
                                    split)
    check_step(stages, losses, grads, want_losses, want_grads)
    check_sgd(stages, grads, want_after)  # an SGD step gives the reference's parameters


def test_context_parallel_stage_names_what_it_cannot_run(world):
    mesh = jaxpg.init_device_mesh((2, CP), ("pp", "cp"))
    with pytest.raises(ValueError, match="with context_parallel_group= is not offered"):
        PipelineStage(AttentionHead(mesh["cp"], nnx.Rngs(0)), 0, 2, group=mesh["pp"],
                      context_parallel_group=mesh["cp"], expert_parallel_group=mesh["cp"])
    with pytest.raises(ValueError, match=r"shares ranks \[0, 4\] with the pipeline group"):
        PipelineStage(AttentionHead(mesh["cp"], nnx.Rngs(0)), 0, 2, group=mesh["pp"],
                      context_parallel_group=mesh["pp"])
    stage = PipelineStage(AttentionHead(mesh["cp"], nnx.Rngs(0)), 1, 2, group=mesh["pp"],
                          context_parallel_group=mesh["cp"])
    with pytest.raises(ValueError, match=r"a microbatch of 6 positions along dimension 1 .* "
                                         r"does not split over this process's 4 devices"):
        stage.layout.to_global(jnp.zeros((2, 6, D)))
    with pytest.raises(ValueError, match=r"an activation of shape \(2,\) has no dimension 1"):
        stage.layout.to_global(jnp.zeros((2,)))
