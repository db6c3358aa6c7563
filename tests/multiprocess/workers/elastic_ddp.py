"""Worker: DDP training with a checkpoint after every step, resumable, with injected faults.

    elastic_ddp.py CKPT_DIR OUT.npz STEPS FAULT

Each step: an eager barrier (the named timeout bounds a stuck peer there), one DDP step on
this rank's slice of a global batch that depends only on the step number, then a checkpoint
(``data_state={"step": next step}``). On start it resumes from the latest complete
checkpoint and prints ``RESUMED step=S``. At the end rank 0 saves the parameters to OUT.npz.

FAULT is a comma-separated list: its i-th fault is armed on attempt i
(``TORCHELASTIC_RESTART_COUNT=i``), so one launch can chain several faults, each attempt
resuming from what the previous one left. A fault is one of:

* ``none``;
* ``kill:R:S``: rank R dies (SIGKILL) right after step S's checkpoint;
* ``killmid:R:S``: rank R dies after step S's update, before its checkpoint;
* ``stop:R:S``: rank R SIGSTOPs itself before step S's barrier;
* ``killbefore:R:S``: rank R dies (SIGKILL) before step S's barrier;
* ``killduring:R:S``: rank R dies 0.2 s into step S, after the barrier (in the DDP step's
  collectives or the checkpoint write, whichever it is in);
* ``raise:R:S``: rank R raises before step S's barrier (a Python error, exit code 1);
* ``ckpt:R:S``: rank R dies while writing step S's checkpoint (its files written, before
  orbax commits it by renaming the temporary directory);
* ``ackpt:R:S``: ``ckpt`` with asynchronous checkpoints on this attempt (as
  ``ELASTIC_ASYNC=1``): rank R dies in orbax's background commit, during the next step;
* ``damage:R:S``: once every rank has written step S's checkpoint, rank R cuts its array
  files in half and dies (SIGKILL): the next attempt restores the checkpoint before it;
* ``random:SEED``: ``killmid`` at a rank and at a step from the resumed one on, drawn from
  ``random.Random(SEED)``.

On an attempt whose fault is ``stop``, the group timeout is ``FAULT_GROUP_TIMEOUT`` seconds
(60 otherwise), so the waiting rank names the stopped one soon.

With ``ELASTIC_ASYNC=1`` the checkpoints are asynchronous (``async_save=True``): a ``ckpt``
fault then kills the rank in orbax's background commit, during the next step.
"""

import datetime
import os
import random
import signal
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxpg
from jaxpg import ddp as jddp

ckpt_dir, out_path, steps, faults = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
faults = faults.split(",")
fault = faults[attempt] if attempt < len(faults) else "none"
kind, *spec = fault.split(":")
timeout = float(os.environ.get("FAULT_GROUP_TIMEOUT", "60")) if kind == "stop" else 60.0
jaxpg.init_process_group(timeout=datetime.timedelta(seconds=timeout))
rank, n = jaxpg.get_rank(), jaxpg.get_world_size()


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.tanh(self.l1(x)))


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def batch_for(step: int) -> dict:
    g = np.random.default_rng(1000 + step)
    x = g.normal(size=(4 * n, 4)).astype(np.float32)
    y = np.sin(x.sum(-1, keepdims=True)).astype(np.float32)
    return {"x": x[4 * rank: 4 * rank + 4], "y": y[4 * rank: 4 * rank + 4]}


ddp = jddp.DistributedDataParallel(Net(nnx.Rngs(0)), optax.adam(1e-2))
start = 0
if jddp.latest_step(ckpt_dir) is not None:
    _, data_state = jddp.restore_checkpoint(ckpt_dir, ddp)
    start = data_state["step"]
print(f"RESUMED step={start} attempt={attempt}", flush=True)

if kind == "random":
    rng = random.Random(int(spec[0]))
    kind, spec = "killmid", [rng.randrange(n), rng.randrange(max(start, 1), steps)]
    print(f"FAULT killmid rank {spec[0]} step {spec[1]}", flush=True)
fault_rank, fault_step = (int(spec[0]), int(spec[1])) if spec else (-1, -1)
armed = rank == fault_rank

if armed and kind in ("ckpt", "ackpt"):
    from orbax.checkpoint._src.path import async_path

    real_rename = async_path.rename

    async def dying_rename(src, dst):
        if os.path.basename(str(dst)) == str(fault_step):
            print(f"dying while committing checkpoint {fault_step}", flush=True)
            die()
        return await real_rename(src, dst)

    async_path.rename = dying_rename

asynchronous = os.environ.get("ELASTIC_ASYNC") == "1" or kind == "ackpt"
for step in range(start, steps):
    if armed and kind == "stop" and step == fault_step:
        print(f"stopping myself at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    if armed and kind == "killbefore" and step == fault_step:
        print(f"dying before the barrier of step {step}", flush=True)
        die()
    if armed and kind == "raise" and step == fault_step:
        raise RuntimeError(f"rank {rank} fails at step {step}")
    jaxpg.barrier()
    if armed and kind == "killduring" and step == fault_step:
        print(f"dying 0.2 s into step {step}", flush=True)
        threading.Timer(0.2, die).start()
    metrics = ddp.train_step(loss_fn, batch_for(step))
    if armed and kind == "killmid" and step == fault_step:
        print(f"dying after the update of step {step}", flush=True)
        die()
    jddp.save_checkpoint(ckpt_dir, ddp, data_state={"step": step + 1},
                         async_save=asynchronous)
    print(f"step {step} loss {float(metrics['loss']):.6f}", flush=True)
    if armed and kind == "damage" and step == fault_step:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: _damage
        from _damage import cut_array_files

        jaxpg.barrier()  # the peer's next barrier: every rank has written this checkpoint
        cut_array_files(os.path.join(ckpt_dir, str(step + 1)))
        print(f"damaged checkpoint {step + 1}, dying", flush=True)
        die()
    if armed and kind == "kill" and step == fault_step:
        print(f"dying after step {step}", flush=True)
        die()

if rank == 0:
    params = nnx.state(ddp.module, nnx.Param)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    np.savez(out_path, **{jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves})
jaxpg.destroy_process_group()
print("DONE", flush=True)
