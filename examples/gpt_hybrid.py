"""Train a GPT with data x pipeline x tensor parallelism (dp=2 x pp=2 x tp=2) on 8 ranks.

The model is examples/pipeline_lm.py's character-level GPT, wider: a token + position
embedding (stage 0), ``pp`` pre-LN transformer blocks (one pipeline stage each) and a
LayerNorm + linear head with the cross-entropy loss (last stage). One
HybridCommunicateGroup holds the three axes ("dp", "pp", "mp"):

* tensor parallelism (Megatron's, with torch's plan API): the token embedding is split on
  the vocabulary (RowwiseParallel), each block's fused QKV and MLP-up projections on their
  outputs (ColwiseParallel) and its attention output and MLP-down projections on their
  inputs (RowwiseParallel), the head on the vocabulary, and the loss is Paddle's
  ParallelCrossEntropy over the split logits. ``--sequence-parallel`` splits the
  LayerNorms and the residual stream along the sequence inside each block (all-gathers
  before the column-parallel matmuls, reduce-scatters after the row-parallel ones);
* pipeline parallelism: 1F1B over ``pp`` stages (``--schedule``);
* data parallelism: the batch is split over ``dp``; gradients are averaged.

It also trains the same model on one device, from the same initial weights on the same
batches, prints both losses, checks that they agree to ``--tol`` after ``--steps`` steps
(exit status 1 if not), and plots both curves.

Run (8 simulated CPU devices in one process; about a minute on 2 cores):

    python examples/gpt_hybrid.py --steps 20 --sequence-parallel

or with one process per rank:

    jaxpg-run --nproc-per-node 8 examples/gpt_hybrid.py --steps 20
"""

import os

if "WORLD_SIZE" not in os.environ:  # one process: simulate the 8 ranks as 8 CPU devices
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpg  # noqa: E402
from jaxpg import tensor_parallel as tp  # noqa: E402
from jaxpg.pipeline import StagedParams, init_train_state, make_train_step  # noqa: E402
from jaxpg.pipeline.stage.nnx_stages import module_fn
from jaxpg.tensor_parallel import (  # noqa: E402
    ColwiseParallel,
    PrepareModuleInputOutput,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
)

SOURCE_FILES = ("os.py", "functools.py", "contextlib.py", "textwrap.py", "string.py")


class Block(nnx.Module):
    """Pre-LN transformer block. ``qkv``'s outputs are ordered [head, (q, k, v), head_dim]
    (Megatron's layout), so splitting them over the tp ranks gives each rank whole heads;
    every shape is read from the array at hand, so the same code runs on whole or split
    activations."""

    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.head_dim = d // heads
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.proj = nnx.Linear(d, d, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        h = self.qkv(self.ln1(x))
        b, t = h.shape[:2]
        h = h.reshape(b, t, -1, 3, self.head_dim)
        q, k, v = h[..., 0, :], h[..., 1, :], h[..., 2, :]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(self.head_dim)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        x = x + self.proj(att.reshape(b, t, -1))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class Embed(nnx.Module):
    def __init__(self, vocab: int, seq: int, d: int, rngs: nnx.Rngs):
        self.tok = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq, d)))

    def __call__(self, ids):
        return self.tok(ids) + self.pos[...][: ids.shape[1]]


class Head(nnx.Module):
    def __init__(self, vocab: int, d: int, rngs: nnx.Rngs):
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.out = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, x):
        return self.out(self.ln(x))


def block_plan(sequence_parallel: bool) -> dict:
    """Megatron's tensor parallelism for a block, as a torch plan."""
    if not sequence_parallel:
        return {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                "up": ColwiseParallel(), "down": RowwiseParallel()}
    return {"ln1": SequenceParallel(), "qkv": ColwiseParallel(input_layouts=Shard(1)),
            "proj": RowwiseParallel(output_layouts=Shard(1)), "ln2": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1))}


def load_text() -> str:
    """A few of the standard library's source files (available offline)."""
    folder = os.path.dirname(os.__file__)
    parts = []
    for name in SOURCE_FILES:
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                parts.append(f.read())
    return "\n".join(parts)


def batches(data: np.ndarray, batch: int, seq: int, seed: int):
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq - 1, batch)
        window = np.stack([data[s : s + seq + 1] for s in starts])
        yield window[:, :-1], window[:, 1:]


def build(args, vocab: int):
    """The model's pieces, built from seeds (every process builds the same)."""
    blocks = [Block(args.dim, args.heads, nnx.Rngs(args.seed + i)) for i in range(args.pp)]
    embed = Embed(vocab, args.seq, args.dim, nnx.Rngs(args.seed + 100))
    head = Head(vocab, args.dim, nnx.Rngs(args.seed + 101))
    return blocks, embed, head


def one_device_trainer(args, vocab: int, optimizer):
    """The same model trained without any parallelism on one (local) device."""
    blocks, embed, head = build(args, vocab)
    block_graph = nnx.split(blocks[0])[0]
    embed_graph, head_graph = nnx.split(embed)[0], nnx.split(head)[0]
    params = (jax.tree.map(lambda *a: jnp.stack(a), *[nnx.state(b) for b in blocks]),
              nnx.state(embed), nnx.state(head))
    params = jax.device_put(params, jax.local_devices()[0])

    def loss_fn(params, x, y):
        stages, first, last = params
        h = nnx.merge(embed_graph, first)(x)
        for i in range(args.pp):
            h = nnx.merge(block_graph, jax.tree.map(lambda a, i=i: a[i], stages))(h)
        logits = nnx.merge(head_graph, last)(h)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, params, optimizer.init(params)


def hybrid_trainer(args, vocab: int, optimizer, hcg):
    """The model with DP x PP x TP on the HybridCommunicateGroup's mesh."""
    blocks, embed, head = build(args, vocab)
    stages = jax.tree.map(lambda *a: jnp.stack(a), *[nnx.state(b) for b in blocks])
    # The template block gives the stage function (its graph runs the plan) and the specs
    # of one stage's parameters; every process built the same weights, so each slices its
    # own copy (src_data_rank=None: no scatter needed).
    template = Block(args.dim, args.heads, nnx.Rngs(args.seed))
    if args.sequence_parallel:  # whole sequences between stages; split inside each block
        tp.parallelize_module(template, hcg, PrepareModuleInputOutput(
            input_layouts=Replicate(), desired_input_layouts=Shard(1),
            output_layouts=Shard(1), desired_output_layouts=Replicate()), src_data_rank=None)
    tp.parallelize_module(template, hcg, block_plan(args.sequence_parallel), src_data_rank=None)
    tp.parallelize_module(embed, hcg, {"tok": RowwiseParallel(input_layouts=Replicate())},
                          src_data_rank=None)
    tp.parallelize_module(head, hcg, {"out": ColwiseParallel()}, src_data_rank=None)
    block_graph, block_state = nnx.split(template)
    specs = StagedParams(tp.param_specs(block_state), tp.param_specs(nnx.state(embed)),
                         tp.param_specs(nnx.state(head)))
    block_fn, embed_fn, head_fn = module_fn(block_graph), module_fn(nnx.split(embed)[0]), \
        module_fn(nnx.split(head)[0])
    cross_entropy = tp.ParallelCrossEntropy(mp_group=hcg)

    def loss_fn(head_state, y, targets):  # logits split on the vocabulary: loss parallel
        return cross_entropy(head_fn(head_state, y), targets).mean()

    params, opt_state = init_train_state(
        StagedParams(stages, nnx.state(embed), nnx.state(head)), optimizer, hcg,
        param_specs=specs)
    step = make_train_step(block_fn, loss_fn, optimizer, mesh=hcg, schedule=args.schedule,
                           num_microbatches=args.microbatches, first_fn=embed_fn,
                           param_specs=specs)
    return step, params, opt_state


def parameter_bytes(params) -> tuple[int, int]:
    """(bytes this process's first device holds, bytes of the whole model)."""
    leaves = jax.tree.leaves(params)
    device = jax.local_devices()[0]
    local = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == device)
    return local, sum(x.nbytes for x in leaves)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (one block each)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="Megatron's sequence parallelism inside each block")
    parser.add_argument("--tol", type=float, default=1e-4,
                        help="largest allowed |loss - one-device loss| at the last step")
    parser.add_argument("--plot", default="gpt_hybrid_loss.png", help="loss-curve PNG path "
                        "('' for none)")
    args = parser.parse_args()

    jaxpg.init_process_group()
    hcg = jaxpg.HybridCommunicateGroup(dp_degree=args.dp, pp_degree=args.pp,
                                       mp_degree=args.tp)
    text = load_text()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = np.array([index[c] for c in text], dtype=np.int32)
    vocab = -(-len(chars) // (8 * args.tp)) * 8 * args.tp  # padded: tp divides it (Megatron)
    optimizer = optax.adamw(args.lr, weight_decay=0.01)

    step, params, opt_state = hybrid_trainer(args, vocab, optimizer, hcg)
    first = jax.process_index() == 0  # it alone also trains the one-device reference
    if first:
        ref_step, ref_params, ref_opt_state = one_device_trainer(args, vocab, optimizer)
    local, total = parameter_bytes(params)
    if first:
        print(f"{len(text):,} characters, vocab {len(chars)} (padded to {vocab}); "
              f"{hcg}, {jax.process_count()} process(es); schedule {args.schedule}, "
              f"{args.microbatches} microbatches; sequence parallel: {args.sequence_parallel}")
        print(f"parameters: {total / 2**20:.2f} MiB in all, {local / 2**20:.2f} MiB on rank 0")

    losses, ref_losses = [], []
    data_iter = batches(data, args.batch, args.seq, args.seed)
    start = time.perf_counter()
    for i in range(args.steps):
        x, y = next(data_iter)
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(float(loss))
        if not first:
            continue
        ref_params, ref_opt_state, ref_loss = ref_step(ref_params, ref_opt_state, x, y)
        ref_losses.append(float(ref_loss))
        if i % 5 == 0 or i == args.steps - 1:
            print(f"step {i:3d}  loss {losses[-1]:.6f}  one device {ref_losses[-1]:.6f}  "
                  f"difference {abs(losses[-1] - ref_losses[-1]):.2e}", flush=True)
    elapsed = time.perf_counter() - start
    diff = abs(losses[-1] - ref_losses[-1]) if first else 0.0
    ok = diff <= args.tol
    if first:
        print(f"{args.steps} steps in {elapsed:.1f}s (both models; the first step compiles)")
        print(f"RESULT after {args.steps} steps: loss {losses[-1]:.6f}, one device "
              f"{ref_losses[-1]:.6f}, |difference| {diff:.2e} "
              f"{'<=' if ok else '>'} {args.tol:g}: {'OK' if ok else 'MISMATCH'}")
    if first and args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(losses, label=f"dp={args.dp} x pp={args.pp} x tp={args.tp}"
                + (" (SP)" if args.sequence_parallel else ""))
        ax.plot(ref_losses, "--", label="one device")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy loss")
        ax.set_title("char GPT, DP x PP x TP vs one device")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"loss curves written to {args.plot}")
    jaxpg.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
