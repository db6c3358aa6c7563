"""A tiny causal GPT whose attention core is ``ContextParallelAttention``, its batches
(ids, targets and position ids, whole sequences) and one-device training on the whole
batch: the reference of the wrapper tests (``test_cp_wrappers.py``, ``workers/cp_worker.py``)."""

import jax
import numpy as np
import optax
from flax import nnx

from jaxpg.context_parallel import ContextParallelAttention

VOCAB, SEQ, DIM, HEADS, BATCH, STEPS = 16, 16, 16, 4, 8, 3


class Block(nnx.Module):
    def __init__(self, attn: nnx.Module, rngs: nnx.Rngs):
        self.ln = nnx.LayerNorm(DIM, rngs=rngs)
        # outputs [head, (q, k, v), head_dim]; no bias: the key bias's gradient is zero
        # in exact arithmetic, and Adam would turn its rounding noise into full steps
        self.qkv = nnx.Linear(DIM, 3 * DIM, use_bias=False, rngs=rngs)
        self.attn = attn
        self.proj = nnx.Linear(DIM, DIM, rngs=rngs)
        self.up = nnx.Linear(DIM, 2 * DIM, rngs=rngs)
        self.down = nnx.Linear(2 * DIM, DIM, rngs=rngs)

    def __call__(self, x):
        b, t = x.shape[:2]
        h = self.qkv(self.ln(x)).reshape(b, t, -1, 3, DIM // HEADS)
        x = x + self.proj(self.attn(h[..., 0, :], h[..., 1, :], h[..., 2, :]).reshape(b, t, -1))
        return x + self.down(jax.nn.gelu(self.up(x)))


class GPT(nnx.Module):
    def __init__(self, attn: nnx.Module):
        rngs = nnx.Rngs(0)
        self.tok = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.pos = nnx.Embed(SEQ, DIM, rngs=rngs)
        self.block = Block(attn, rngs)
        self.out = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, ids, pos):
        return self.out(self.block(self.tok(ids) + self.pos(pos)))


def loss_fn(model, batch):
    logits = model(batch["ids"], batch["pos"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def batches(steps: int = STEPS, size: int = BATCH):
    """``steps`` batches of ``size`` random sequences (the same on every process)."""
    rng = np.random.default_rng(7)
    for _ in range(steps):
        window = rng.integers(0, VOCAB, (size, SEQ + 1)).astype(np.int32)
        yield {"ids": window[:, :-1], "targets": window[:, 1:],
               "pos": np.broadcast_to(np.arange(SEQ, dtype=np.int32), (size, SEQ)).copy()}


def one_device(optimizer, steps: int = STEPS, size: int = BATCH):
    """Losses and final parameters of plain training on the whole batch, one device."""
    graph, params = nnx.split(GPT(ContextParallelAttention(group=False)))
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graph, p), batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for batch in batches(steps, size):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return losses, params
