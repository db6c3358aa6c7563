"""Train a GPT with context parallelism (the sequence split over ``cp``) x tensor x data
parallelism, and check it against one-device training.

The model is a small character-level GPT (token + learned position embedding, pre-LN
blocks, LayerNorm + linear head). Each block's attention core is
``jaxpg.context_parallel.ContextParallelAttention``: its sequence shard attends over the
whole sequence by ring attention (``--method``) across the ``cp`` ranks, with the
load-balanced causal layout (rank i holds chunks i and 2cp-1-i; ``shard_sequence``'s
position ids feed the position embedding). Tensor parallelism (torch's plan API) splits
each block's heads over ``tp``. The step runs under ``shard_map`` over the
``("dp", "cp", "tp")`` mesh: the batch over dp, the sequence over cp; each rank's loss is
the mean over its own tokens, and the loss and the gradients are averaged over dp x cp
(every rank holds the same number of tokens, so that is the mean over the global batch).

It also trains the same model on one device from the same weights on the same batches and
checks that the losses agree to ``--tol`` after ``--steps`` steps (exit status 1 if not).

    python examples/gpt_context_parallel.py --cp 2 --tp 2 --dp 2      # 8 simulated devices
    jaxpg-run --nproc-per-node 4 examples/gpt_context_parallel.py --cp 2 --tp 1 --dp 2
"""

import os

if "WORLD_SIZE" not in os.environ:  # one process: simulate the ranks as CPU devices
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpg  # noqa: E402
from jaxpg import tensor_parallel as tp  # noqa: E402
from jaxpg.context_parallel import ContextParallelAttention  # noqa: E402
from jaxpg.context_parallel.chunks import local_positions  # noqa: E402
from jaxpg.tensor_parallel import ColwiseParallel, RowwiseParallel  # noqa: E402


class Block(nnx.Module):
    """Pre-LN block; ``qkv``'s outputs are ordered [head, (q, k, v), head_dim] so a tp
    split gives each rank whole heads. ``attn`` is the attention core."""

    def __init__(self, d: int, heads: int, attn: nnx.Module, rngs: nnx.Rngs):
        self.head_dim = d // heads
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.attn = attn
        self.proj = nnx.Linear(d, d, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        b, t = x.shape[:2]
        h = self.qkv(self.ln1(x)).reshape(b, t, -1, 3, self.head_dim)
        att = self.attn(h[..., 0, :], h[..., 1, :], h[..., 2, :])
        x = x + self.proj(att.reshape(b, t, -1))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class GPT(nnx.Module):
    def __init__(self, vocab, seq, d, heads, layers, attn, seed):
        rngs = nnx.Rngs(seed)
        self.tok = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Embed(seq, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, heads, attn, rngs) for _ in range(layers)])
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.out = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, ids, positions):
        h = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            h = block(h)
        return self.out(self.ln(h))


def batches(vocab: int, batch: int, seq: int, seed: int):
    """Random character-like sequences with a learnable rule (next = (prev * 3 + 1) % V)."""
    rng = np.random.default_rng(seed)
    while True:
        start = rng.integers(0, vocab, (batch, 1))
        noise = rng.random((batch, seq + 1)) < 0.1
        window = np.zeros((batch, seq + 1), np.int32)
        window[:, :1] = start
        for i in range(1, seq + 1):
            window[:, i] = (window[:, i - 1] * 3 + 1) % vocab
        window = np.where(noise, rng.integers(0, vocab, window.shape), window).astype(np.int32)
        yield window[:, :-1], window[:, 1:]


def loss_of(model, ids, positions, targets):
    logits = model(ids, positions)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def one_device(args, optimizer):
    model = GPT(args.vocab, args.seq, args.dim, args.heads, args.layers,
                ContextParallelAttention(group=False), args.seed)
    graph, params = nnx.split(model)
    positions = jnp.arange(args.seq)[None]

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(
            lambda p: loss_of(nnx.merge(graph, p), x, positions, y))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, params, optimizer.init(params)


def context_parallel(args, optimizer):
    mesh = jaxpg.init_device_mesh((args.dp, args.cp, args.tp), ("dp", "cp", "tp"))
    attn = ContextParallelAttention(group=mesh["cp"], causal=True, method=args.method)
    model = GPT(args.vocab, args.seq, args.dim, args.heads, args.layers, attn, args.seed)
    plan = {f"blocks.{i}.{name}": style for i in range(args.layers)
            for name, style in (("qkv", ColwiseParallel()), ("proj", RowwiseParallel()),
                                ("up", ColwiseParallel()), ("down", RowwiseParallel()))}
    if args.tp > 1:
        tp.parallelize_module(model, mesh["tp"], plan, src_data_rank=None)
    graph, params = nnx.split(model)
    specs = tp.param_specs(params)
    params = jax.tree.map(lambda a, s: _place(np.asarray(a), mesh, s), params, specs)
    # the moments are laid out as the parameters; the step count is replicated
    opt_specs = optax.tree_map_params(
        optimizer, lambda _, spec: spec, jax.eval_shape(optimizer.init, params), specs,
        transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))
    opt_state = jax.jit(jax.shard_map(optimizer.init, mesh=mesh.jax_mesh, in_specs=(specs,),
                                      out_specs=opt_specs, check_vma=False))(params)
    seq_spec = P("dp", "cp")

    def body(params, opt_state, x, positions, y):
        def local_loss(p):
            return loss_of(nnx.merge(graph, p), x, positions[0], y)

        loss, grads = jax.value_and_grad(local_loss)(params)
        grads = jax.lax.pmean(grads, ("dp", "cp"))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state,
                jax.lax.pmean(loss, ("dp", "cp")))

    step = jax.jit(jax.shard_map(
        body, mesh=mesh.jax_mesh, in_specs=(specs, opt_specs, seq_spec, P(None, "cp"), seq_spec),
        out_specs=(specs, opt_specs, P()), check_vma=False))
    # the load-balanced layout: rank r's tokens are at these global positions, and the
    # sequence dimension sharded over cp in this order gives each rank its shard
    order = np.concatenate([local_positions(r, args.cp, args.seq // args.cp, True)
                            for r in range(args.cp)])

    def run(params, opt_state, x, y):
        glob = [_place(a[:, order], mesh, seq_spec) for a in (x, y)]
        pos = _place(order[None], mesh, P(None, "cp"))
        return step(params, opt_state, glob[0], pos, glob[1])

    return run, params, opt_state


def _place(value: np.ndarray, mesh, spec):
    """A global array from ``value`` (the same on every process) laid out by ``spec``."""
    sharding = NamedSharding(mesh.jax_mesh, spec)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--method", default="ring", choices=("ring", "all_to_all", "all_gather"))
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tol", type=float, default=1e-4)
    args = parser.parse_args()

    jaxpg.init_process_group()
    optimizer = optax.adamw(args.lr, weight_decay=0.01)
    step, params, opt_state = context_parallel(args, optimizer)
    ref_step, ref_params, ref_opt_state = one_device(args, optimizer)
    first = jax.process_index() == 0
    data = batches(args.vocab, args.batch, args.seq, args.seed)
    diff = 0.0
    for i in range(args.steps):
        x, y = next(data)
        params, opt_state, loss = step(params, opt_state, x, y)
        ref_params, ref_opt_state, ref_loss = ref_step(ref_params, ref_opt_state, x, y)
        diff = abs(float(loss) - float(ref_loss))
        if first and (i % 5 == 0 or i == args.steps - 1):
            print(f"step {i:3d}  loss {float(loss):.6f}  one device {float(ref_loss):.6f}  "
                  f"difference {diff:.2e}", flush=True)
    ok = diff <= args.tol
    if first:
        print(f"RESULT dp={args.dp} x cp={args.cp} x tp={args.tp} ({args.method}), "
              f"{jax.process_count()} process(es), after {args.steps} steps: |difference| "
              f"{diff:.2e} {'<=' if ok else '>'} {args.tol:g}: {'OK' if ok else 'MISMATCH'}")
    jaxpg.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
