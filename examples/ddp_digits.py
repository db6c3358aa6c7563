"""Train an MLP on scikit-learn's handwritten digits with jaxpg's DistributedDataParallel.

The data set (8x8 images, 10 classes, 1797 samples) ships inside scikit-learn, so nothing
is downloaded. The model is a small MLP with a synchronised BatchNorm; the optimizer is
Adam; every rank reads its share of each epoch through a ``DistributedSampler``.

One process, N simulated CPU devices (one rank per device)::

    python examples/ddp_digits.py --devices 4 --epochs 20

Under the launcher, one device per process (``init_process_group`` reads the launcher's
environment; ``--devices`` is then ignored)::

    jaxpg-run --nproc-per-node 2 examples/ddp_digits.py --epochs 20

``--batch-size`` is the *global* batch: each rank trains on ``batch_size / world_size``
samples per step, whatever the number of processes. With ``--checkpoint-dir`` the run saves
a checkpoint after every epoch and, when started again, resumes from the latest one; under
``jaxpg-run --max-restarts N`` a run that loses a worker restarts and carries on from the
last completed epoch, to the same result as a run that never stopped::

    jaxpg-run --nproc-per-node 2 --max-restarts 3 examples/ddp_digits.py --checkpoint-dir ckpt

Only rank 0 prints and draws the progress bar.
"""

import os
import sys


def _early_devices_flag() -> None:
    """Sets XLA_FLAGS for --devices before JAX is imported (not under the launcher)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return
    n = 4
    for i, arg in enumerate(sys.argv):
        if arg == "--devices" and i + 1 < len(sys.argv):
            n = int(sys.argv[i + 1])
        elif arg.startswith("--devices="):
            n = int(arg.split("=", 1)[1])
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


_early_devices_flag()

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jaxpg  # noqa: E402
from jaxpg import ddp as jddp  # noqa: E402


class MLP(nnx.Module):
    """64 -> hidden -> hidden -> 10, with a BatchNorm after the first layer."""

    def __init__(self, hidden: int, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(64, hidden, rngs=rngs)
        self.bn = nnx.BatchNorm(hidden, rngs=rngs)
        self.l2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.bn(self.l1(x)))
        return self.out(jax.nn.relu(self.l2(h)))


def loss_fn(model, batch):
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=4,
                   help="simulated CPU devices (= ranks) in one process; ignored under jaxpg-run")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64, help="global batch size")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--comm-hook", default="allreduce",
                   help="allreduce, fp16_compress, bf16_compress, noop or powerSGD")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def load_data(seed: int):
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    return train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)


def main() -> None:
    args = parse_args()
    jaxpg.init_process_group()
    world = jaxpg.GroupMember.WORLD
    n, local = world.size(), world.local_members()
    if args.batch_size % n:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the {n} ranks.")
    per_rank = args.batch_size // n
    is_main = jaxpg.get_rank() == 0
    x_train, x_test, y_train, y_test = load_data(args.seed)

    model = jddp.convert_sync_batchnorm(MLP(args.hidden, nnx.Rngs(args.seed)), world)
    hook_config = {"start_powerSGD_iter": 10} if args.comm_hook.lower() == "powersgd" else None
    ddp = jddp.DistributedDataParallel(
        model, optax.adam(args.lr), bucket_cap_mb=args.bucket_cap_mb,
        comm_hook=args.comm_hook, comm_hook_config=hook_config,
    )  # fmt: skip
    if is_main:
        print(f"{n} ranks ({len(local)} in this process), {per_rank} samples per rank and step")
        print(ddp.bucket_plan)

    samplers = [jddp.DistributedSampler(len(x_train), n, r, shuffle=True, seed=args.seed,
                                        drop_last=True) for r in local]
    steps = len(samplers[0]) // per_rank
    start_epoch = 0
    if args.checkpoint_dir and jddp.latest_step(args.checkpoint_dir) is not None:
        _, data_state = jddp.restore_checkpoint(args.checkpoint_dir, ddp)
        start_epoch = data_state["epoch"]
        if is_main:
            print(f"resumed from {args.checkpoint_dir} at step {ddp.step}, epoch {start_epoch}")

    t0 = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        for s in samplers:
            s.set_epoch(epoch)
        indices = [s.indices() for s in samplers]
        losses, accs = [], []
        bar = tqdm(range(steps), desc=f"epoch {epoch + 1}/{args.epochs}", disable=not is_main,
                   leave=False)
        for b in bar:
            idx = np.concatenate([i[b * per_rank:(b + 1) * per_rank] for i in indices])
            metrics = ddp.train_step(loss_fn, {"x": x_train[idx], "y": y_train[idx]},
                                     has_aux=True)
            losses.append(float(metrics["loss"]))
            accs.append(float(metrics["aux"]["accuracy"]))
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if args.checkpoint_dir:  # before the report: a printed epoch is a saved epoch
            jddp.save_checkpoint(args.checkpoint_dir, ddp, data_state={"epoch": epoch + 1})
        if is_main:
            print(f"epoch {epoch + 1:3d}  loss {np.mean(losses):.4f}  "
                  f"train accuracy {np.mean(accs):.3f}")

    # Evaluate on the host: the parameters are replicated, so every process has them all.
    graphdef, params, rest = nnx.split(ddp.module, nnx.Param, ...)
    host = nnx.merge(graphdef, *jax.tree.map(np.asarray, (params, rest)))
    for _, node in nnx.iter_graph(host):  # outside the DDP step no axis is bound
        if isinstance(node, nnx.BatchNorm):
            node.axis_name = None
    host.eval()
    accuracy = float(jnp.mean(jnp.argmax(host(jnp.asarray(x_test)), -1) == y_test))
    if is_main:
        print(f"test accuracy {accuracy:.4f}  ({len(x_test)} samples, "
              f"{time.perf_counter() - t0:.1f}s training)")
    jaxpg.destroy_process_group()


if __name__ == "__main__":
    main()
