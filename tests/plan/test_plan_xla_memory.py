"""Memory from XLA: a Flax NNX GPT block compiled at a layout's shapes, against the formulas."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpg.plan import Job, Layout, TransformerSpec, memory
from jaxpg.plan.activations import block_activation_bytes
from jaxpg.plan.xla_memory import compiled_block, xla_memory

DIM, HEADS, FFN, SEQ, BATCH = 256, 4, 1024, 256, 2
SPEC = TransformerSpec(layers=8, dim=DIM, heads=HEADS, ffn=FFN, vocab=1024, mlp="gelu",
                       flash_attention=False, name="tiny-gpt")


@jax.custom_vjp
def masked_softmax(scores):
    """Causal softmax that keeps only its output, as Megatron's fused scale-mask-softmax."""
    s = scores.shape[-1]
    return jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e4), axis=-1)


def _softmax_fwd(scores):
    probs = masked_softmax(scores)
    return probs, probs


def _softmax_bwd(probs, g):
    return (probs * (g - jnp.sum(g * probs, axis=-1, keepdims=True)),)


masked_softmax.defvjp(_softmax_fwd, _softmax_bwd)


class Block(nnx.Module):
    """A GPT block (pre-norm, GeLU MLP) in bf16, with its norms, GeLU and softmax fused as
    Megatron's kernels are: the norms and GeLU save only their input (``jax.checkpoint``),
    the softmax only its output."""

    def __init__(self, rngs):
        kw = dict(use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)
        self.ln1 = nnx.LayerNorm(DIM, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)
        self.ln2 = nnx.LayerNorm(DIM, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)
        self.q, self.k, self.v = (nnx.Linear(DIM, DIM, **kw) for _ in range(3))
        self.o = nnx.Linear(DIM, DIM, **kw)
        self.up = nnx.Linear(DIM, FFN, **kw)
        self.down = nnx.Linear(FFN, DIM, **kw)

    def __call__(self, x):
        b, s, _ = x.shape
        h = jax.checkpoint(lambda y: self.ln1(y))(x)
        heads = lambda t: t.reshape(b, s, HEADS, DIM // HEADS)  # noqa: E731
        q, k, v = heads(self.q(h)), heads(self.k(h)), heads(self.v(h))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(DIM / HEADS).astype(x.dtype)
        probs = masked_softmax(scores)
        att = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, DIM)
        x = x + self.o(att)
        h = jax.checkpoint(lambda y: self.ln2(y))(x)
        return x + self.down(jax.checkpoint(jax.nn.gelu)(self.up(h)))


def megatron_plan(path, leaf):
    """Column-parallel q, k, v and up; row-parallel o and down; norms replicated."""
    name = path[0].key if hasattr(path[0], "key") else str(path[0])
    if leaf.ndim != 2:
        return P()
    return P(None, "tp") if name in ("q", "k", "v", "up") else P("tp", None)


def _block(tp, remat, batch=BATCH, seq=SEQ):
    x = jax.ShapeDtypeStruct((batch, seq, DIM), jnp.bfloat16)
    return compiled_block(lambda: Block(nnx.Rngs(0)), x, tp=tp, param_spec=megatron_plan,
                          remat=remat)


@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("remat", ["none", "full"])
def test_compiled_saved_activations_match_korthikanti(tp, remat):
    got = _block(tp, remat)
    want = block_activation_bytes(SPEC, moe=False, tokens=BATCH * SEQ, seq_len=SEQ, tp=tp,
                                  sp=False, remat=remat)
    assert got.saved_bytes == pytest.approx(want, rel=0.15)
    assert got.param_count == pytest.approx((4 * DIM * DIM + 2 * DIM * FFN) / tp + 4 * DIM)


def test_selective_recomputation_drops_the_attention_scores():
    none, selective, full = (_block(1, r).saved_bytes for r in ("none", "selective", "full"))
    scores = BATCH * HEADS * SEQ * SEQ * 2
    assert full < selective < none - 0.8 * scores


def test_xla_memory_of_a_pipelined_layout_agrees_with_the_formulas():
    job = Job(model=SPEC, devices=8, hardware="a100-80gb", seq_len=SEQ, global_batch=16,
              dtype="bf16")
    lay = Layout(dp_shard=2, tp=2, pp=2, microbatches=4, remat="none", sp=False, zero=1)
    block = _block(2, "none", batch=16 // (2 * 4))
    compiled, formula = xla_memory(job, lay, block), memory(job, lay)
    assert compiled.activations == pytest.approx(formula.activations, rel=0.15)
    assert compiled.params + compiled.optimizer == pytest.approx(
        formula.params + formula.optimizer, rel=0.02)
    assert compiled.total == pytest.approx(formula.total, rel=0.2)
    with pytest.raises(ValueError, match="remat='full'"):
        xla_memory(job, lay.replace(remat="full"), block)
