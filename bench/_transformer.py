"""A GPT-style decoder in Flax NNX for the FSDP memory benchmark (``bench/fsdp_memory.py``).

Token embedding, ``depth`` pre-norm blocks (causal multi-head self-attention with a fused
``qkv`` projection, a 4x GELU MLP), a final LayerNorm and an untied head. With the
defaults (``d=768``, 12 heads, ``depth=12``, vocabulary 32768) it has about 110M
parameters: 85M in the blocks, 25M in each of the embedding and the head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

VOCAB, D, HEADS, SEQ = 32768, 768, 12, 128


class Block(nnx.Module):
    """One pre-norm decoder block: an FSDP unit."""

    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.heads = heads
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.out = nnx.Linear(d, d, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
        q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // self.heads)
        mask = jnp.tril(jnp.ones((t, t), bool))
        att = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
        x = x + self.out(jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class GPT(nnx.Module):
    def __init__(self, depth: int = 12, d: int = D, heads: int = HEADS, vocab: int = VOCAB,
                 seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Param(jnp.zeros((SEQ, d)))
        self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(depth)])
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def loss_fn(model, batch):
    """Next-token cross-entropy."""
    logits = model(batch["tokens"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()


def n_params(model) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
