"""Train a small GPT-style character-level language model with DP x PP on 8 CPU devices.

The model: a token + position embedding (stage 0), ``pp * chunks`` identical pre-LN
transformer blocks (one pipeline stage each) and a LayerNorm + linear head with the
cross-entropy loss (last stage). The text is the Python standard library's own source
(a few files next to the ``os`` module), so the example runs offline.

Run (about 2-3 minutes on 2 CPU cores with the defaults):

    python examples/pipeline_lm.py --steps 1000 --schedule 1f1b --microbatches 4 \
        --plot pipeline_lm_loss.png
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jaxpg  # noqa: E402
from jaxpg.pipeline.api import StagedParams  # noqa: E402
from jaxpg.pipeline.stage.nnx_stages import module_fn, split_module, stack_modules  # noqa: E402
from jaxpg.pipeline.train_step import init_train_state, make_train_step  # noqa: E402

SOURCE_FILES = ("os.py", "functools.py", "contextlib.py", "textwrap.py", "string.py")


class Block(nnx.Module):
    """Pre-LN transformer block: causal self-attention and an MLP, both residual."""

    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.heads = heads
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.proj = nnx.Linear(d, d, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
        q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // self.heads)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        x = x + self.proj(att.reshape(b, t, d))
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
        yield jnp.asarray(window[:, :-1]), jnp.asarray(window[:, 1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--pp", type=int, default=4, help="pipeline stages (ranks)")
    parser.add_argument("--chunks", type=int, default=1, help="chunks per rank (interleaved)")
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="pipeline_lm_loss.png", help="loss-curve PNG path")
    args = parser.parse_args()

    text = load_text()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = np.array([index[c] for c in text], dtype=np.int32)
    vocab = len(chars)

    mesh = jaxpg.ParallelDims(dp_replicate=len(jax.devices()) // args.pp, pp=args.pp)
    num_stages = args.pp * args.chunks
    graphdef, stages = stack_modules(
        lambda rngs: Block(args.dim, args.heads, rngs), num_stages, seed=args.seed
    )
    embed_g, embed_s = split_module(Embed(vocab, args.seq, args.dim, nnx.Rngs(args.seed + 100)))
    head_g, head_s = split_module(Head(vocab, args.dim, nnx.Rngs(args.seed + 101)))
    block, embed, head = module_fn(graphdef), module_fn(embed_g), module_fn(head_g)

    def loss_fn(head_state, y, targets):
        logits = head(head_state, y)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    optimizer = optax.adamw(args.lr, weight_decay=0.01)
    params, opt_state = init_train_state(StagedParams(stages, embed_s, head_s), optimizer, mesh)
    step = make_train_step(
        block, loss_fn, optimizer, mesh=mesh, schedule=args.schedule,
        num_microbatches=args.microbatches, first_fn=embed,
    )  # fmt: skip
    print(
        f"{len(text):,} characters, vocab {vocab}; mesh {dict(mesh.shape)}; {num_stages} "
        f"blocks; schedule {args.schedule}, {args.microbatches} microbatches"
    )

    losses = []
    data_iter = batches(data, args.batch, args.seq, args.seed)
    start = time.perf_counter()
    # One bar per job: under a launcher only process 0 draws it.
    first = jax.process_index() == 0
    with tqdm(range(args.steps), desc="train", unit="step", disable=not first) as bar:
        for i in bar:
            x, y = next(data_iter)
            params, opt_state, loss = step(params, opt_state, x, y)
            losses.append(float(loss))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if i % 10 == 0 or i == args.steps - 1:
                tqdm.write(f"step {i:4d}  loss {losses[-1]:.4f}")
    elapsed = time.perf_counter() - start
    print(f"{args.steps} steps in {elapsed:.1f}s (first step includes compilation)")

    # Greedy sample with the un-pipelined model (the same parameters, applied in order).
    @jax.jit
    def next_id(params, ids):
        h = embed(params.first, ids)
        for s in range(num_stages):
            h = block(jax.tree.map(lambda a, s=s: a[s], params.stages), h)
        return jnp.argmax(head(params.last, h)[:, -1], -1)

    params = jax.device_get(params)
    ids = jnp.asarray(data[: args.seq])[None]
    for _ in range(80):
        ids = jnp.concatenate([ids, next_id(params, ids[:, -args.seq :])[:, None]], axis=1)
    print("sample:", repr("".join(chars[int(i)] for i in ids[0, args.seq :])))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(losses)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(f"char LM, DP={mesh.shape['dp']} x PP={args.pp}, {args.schedule}")
    fig.tight_layout()
    fig.savefig(args.plot)
    print(f"loss curve written to {args.plot}")


if __name__ == "__main__":
    main()
