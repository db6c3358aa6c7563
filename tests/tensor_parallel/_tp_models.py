"""Models for the tensor-parallel tests: a GPT block (fused, head-major QKV, as Megatron
lays it out), a block with separate q/k/v projections (torchtitan's), and their plans."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpg.tensor_parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
)


def attention(q, k, v):
    """Causal attention over [b, t, heads, hd]; shapes come from the arrays themselves."""
    t, hd = q.shape[1], q.shape[-1]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


class Block(nnx.Module):
    """Pre-LN block; ``qkv``'s output features are ordered [head, (q, k, v), hd], so a
    column split gives each rank whole heads."""

    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.hd = d // heads
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.proj = nnx.Linear(d, d, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        h = self.qkv(self.ln1(x))
        b, t = h.shape[:2]
        h = h.reshape(b, t, -1, 3, self.hd)
        a = attention(h[..., 0, :], h[..., 1, :], h[..., 2, :]).reshape(b, t, -1)
        x = x + self.proj(a)
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class Attention(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.hd = d // heads
        self.wq = nnx.Linear(d, d, rngs=rngs)
        self.wk = nnx.Linear(d, d, rngs=rngs)
        self.wv = nnx.Linear(d, d, rngs=rngs)
        self.wo = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        b, t = x.shape[:2]
        q, k, v = (w(x).reshape(b, t, -1, self.hd) for w in (self.wq, self.wk, self.wv))
        return self.wo(attention(q, k, v).reshape(b, t, -1))


class TitanBlock(nnx.Module):
    """torchtitan's layout: separate wq/wk/wv under an ``attention`` module."""

    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.attention_norm = nnx.LayerNorm(d, rngs=rngs)
        self.attention = Attention(d, heads, rngs)

    def __call__(self, x):
        return x + self.attention(self.attention_norm(x))


def block_plan(sp: bool) -> dict:
    """Megatron's plan for :class:`Block`, with or without sequence parallelism."""
    if not sp:
        return {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                "up": ColwiseParallel(), "down": RowwiseParallel()}
    return {"ln1": SequenceParallel(), "qkv": ColwiseParallel(input_layouts=Shard(1)),
            "proj": RowwiseParallel(output_layouts=Shard(1)), "ln2": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1))}


def titan_plan(sp: bool) -> dict:
    """torchtitan's plan for :class:`TitanBlock`."""
    src = Shard(1) if sp else Replicate()
    plan = {"attention": PrepareModuleInput(input_layouts=(src,),
                                            desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())}
    if sp:
        plan["attention_norm"] = SequenceParallel()
    return plan


def max_diff(a, b) -> float:
    """Largest absolute difference over two pytrees of arrays of one structure."""
    diffs = jax.tree.map(lambda x, y: float(np.max(np.abs(np.asarray(x) - np.asarray(y)))),
                         a, b)
    return max(jax.tree.leaves(diffs))


def spmd_grad(fn, mesh, state_specs, x_spec, *, reduce_loss: bool = False):
    """``jit(shard_map(value_and_grad(fn)))`` over ``mesh``: ``fn(state, x) -> scalar``,
    gradients for the state and the input; ``reduce_loss`` sums a per-rank partial loss."""

    def body(state, x):
        loss, grads = jax.value_and_grad(fn, argnums=(0, 1))(state, x)
        return (jax.lax.psum(loss, "tp") if reduce_loss else loss), grads

    return jax.jit(jax.shard_map(body, mesh=mesh.jax_mesh, in_specs=(state_specs, x_spec),
                                 out_specs=(P(), (state_specs, x_spec)), check_vma=False))
