"""A small mixture-of-experts GPT trained with expert parallelism × data parallelism.

Every block's MLP is a ``jaxpg.expert_parallel.MoELayer`` whose experts are split over the
``ep`` axis of a ``("dp", "ep")`` mesh, and ``jaxpg.DistributedDataParallel`` runs over the
whole mesh with ``expert_axes=("ep",)``: the batch is split over both axes, each rank
computes its gradients (the all_to_all's backward brings its experts the gradients of
every token of its ep group), then the dense parameters are averaged over ``("dp", "ep")``
(every rank saw different tokens) and the experts' over ``"dp"`` only (the ranks that
replicate them). The same model is trained on one device on the whole batch (its dp halves'
losses averaged, as data parallelism does) and the losses must agree to 1e-4.

    python examples/moe_gpt.py                                    # 4 simulated devices
    jaxpg-run --nproc-per-node 4 examples/moe_gpt.py              # 4 processes
"""

from __future__ import annotations

import argparse
import os
import sys

if "RANK" not in os.environ and "--xla_force_host_platform_device_count" not in os.environ.get(
        "XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpg  # noqa: E402
from jaxpg.ddp import DistributedDataParallel  # noqa: E402
from jaxpg.expert_parallel import MoELayer  # noqa: E402

AUX_WEIGHT = 0.01
TOL = 1e-4


class Block(nnx.Module):
    """Pre-LN block: causal attention, then a mixture of experts as the MLP."""

    def __init__(self, d, heads, experts, top_k, group, rngs):
        self.heads = heads
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.proj = nnx.Linear(d, d, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.moe = MoELayer(d, 2 * d, experts, top_k=top_k, group=group, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.ln1(x)).reshape(b, t, self.heads, -1), 3, axis=-1)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        x = x + self.proj(att.reshape(b, t, d))
        y, aux = self.moe(self.ln2(x), return_aux=True)
        return x + y, aux.loss


class MoEGPT(nnx.Module):
    def __init__(self, args, group, rngs):
        self.tok = nnx.Embed(args.vocab, args.dim, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (args.seq, args.dim)))
        self.blocks = nnx.List([Block(args.dim, args.heads, args.experts, args.top_k, group,
                                      rngs) for _ in range(args.layers)])
        self.ln = nnx.LayerNorm(args.dim, rngs=rngs)
        self.out = nnx.Linear(args.dim, args.vocab, rngs=rngs)

    def __call__(self, ids):
        x = self.tok(ids) + self.pos[...][: ids.shape[1]]
        aux = 0.0
        for block in self.blocks:
            x, block_aux = block(x)
            aux = aux + block_aux
        return self.out(self.ln(x)), aux


def loss_of(model, ids):
    logits, aux = model(ids[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()
    return ce + AUX_WEIGHT * aux, ce


def batches(args):
    """Sequences that count by a per-sequence step modulo the vocabulary (learnable)."""
    rng = np.random.default_rng(0)
    while True:
        start = rng.integers(0, args.vocab, (args.batch, 1))
        step = rng.integers(1, 4, (args.batch, 1))
        yield ((start + step * np.arange(args.seq + 1)) % args.vocab).astype(np.int32)


def parallel_trainer(args, optimizer):
    mesh = jaxpg.init_device_mesh((args.dp, args.ep), ("dp", "ep"))
    model = MoEGPT(args, mesh.get_group("ep"), nnx.Rngs(0))
    # DDP over the whole mesh (the world): the batch is split over dp and ep; the experts,
    # split over "ep", are averaged over "dp" only, every other parameter over both.
    ddp = DistributedDataParallel(model, optimizer, expert_axes=("ep",))
    rows = args.batch // jax.process_count()  # this process's ranks' rows (process-major)

    def run(ids):
        mine = ids[jax.process_index() * rows:(jax.process_index() + 1) * rows]
        metrics = ddp.train_step(loss_of, mine, has_aux=True)
        return float(metrics["aux"])
    return run, model


def one_device_trainer(args, optimizer):
    group, _ = jaxpg.new_subgroups(group_size=1)
    model = MoEGPT(args, group, nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    opt_state = optimizer.init(state)

    def loss_fn(state, ids):  # the dp halves' losses averaged, as data parallelism does
        halves = [loss_of(nnx.merge(graphdef, state), part) for part in
                  jnp.split(ids, args.dp)]
        return (sum(h[0] for h in halves) / args.dp, sum(h[1] for h in halves) / args.dp)

    @jax.jit
    def step(state, opt_state, ids):
        (_, ce), grads = jax.value_and_grad(loss_fn, has_aux=True)(state, ids)
        updates, opt_state = optimizer.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, ce

    def run(ids):
        nonlocal state, opt_state
        state, opt_state, ce = step(state, opt_state, jnp.asarray(ids))
        return float(ce)
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    jaxpg.init_process_group()
    optimizer = optax.sgd(0.5)  # plain SGD: a wrongly scaled gradient shows (Adam hides it)
    parallel, model = parallel_trainer(args, optimizer)
    reference = one_device_trainer(args, optimizer)
    rank = jaxpg.get_rank()
    data = batches(args)
    for i in range(args.steps):
        ids = next(data)
        got, want = parallel(ids), reference(ids)
        if rank == 0 and (i % 5 == 0 or i == args.steps - 1):
            print(f"step {i}: loss {got:.6f}, one device {want:.6f}", flush=True)
    diff = abs(got - want)
    verdict = "OK" if diff <= TOL else "MISMATCH"
    print(f"RESULT after {args.steps} steps: loss {got:.6f}, one device "
          f"{want:.6f}, |difference| {diff:.2e} <= {TOL}: {verdict} (dp={args.dp} x "
          f"ep={args.ep}, {args.experts} experts, {model.blocks[0].moe.num_local_experts} "
          "per rank)", flush=True)
    jaxpg.destroy_process_group()
    return 0 if diff <= TOL else 1


if __name__ == "__main__":
    sys.exit(main())
