"""Worker: FSDP training under --nnodes MIN:MAX, resumable on another world size.

    elastic_fsdp.py CKPT_DIR OUT.npz STEPS

A fixed global batch of 12 samples per step, drawn by ``DistributedSampler`` (this rank's
share of the step's slice of the epoch's permutation), so the global batch of a step is the
same whatever the world size. An asynchronous checkpoint every 2 steps; on start it resumes
from the newest complete one onto this world (resharded). On the first attempt the rank of
node 2 (where ``ELASTIC_KILLME`` is set: on the first attempt with 3 processes, the ranks
where it is 1) prints ``KILLME`` after step 4's update and waits to be killed with its node. At the
end rank 0 writes the full parameters to OUT.npz.
"""

import datetime
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fsdp"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _fsdp_models import Block, Net, loss_fn  # noqa: E402

import jaxpg  # noqa: E402
from jaxpg import fsdp as jfsdp  # noqa: E402
from jaxpg.ddp import DistributedSampler  # noqa: E402

GLOBAL, SAMPLES, STEPS_PER_EPOCH = 12, 48, 4
ckpt_dir, out_path, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])


def dataset():
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((SAMPLES, 7)).astype(np.float32),
            "y": rng.integers(0, 5, SAMPLES).astype(np.int32)}


jaxpg.init_process_group(timeout=datetime.timedelta(seconds=60))
rank, n = jaxpg.get_rank(), jaxpg.get_world_size()
if GLOBAL % n:
    raise ValueError(f"the global batch {GLOBAL} does not divide by the world size {n}")
per_rank, data = GLOBAL // n, dataset()
sampler = DistributedSampler(SAMPLES, num_replicas=n, rank=rank, shuffle=True, seed=5)
fsdp = jfsdp.FullyShardedDataParallel(Net(seed=rank), optax.adam(1e-2), units=Block)
start = 0
if jfsdp.latest_step(ckpt_dir) is not None:
    start = jfsdp.restore_checkpoint(ckpt_dir, fsdp)[1]["step"]
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"RESUMED step={start} world={n} attempt={attempt}", flush=True)
for step in range(start, steps):
    epoch, b = divmod(step, STEPS_PER_EPOCH)
    sampler.set_epoch(epoch)
    idx = sampler.indices()[b * per_rank:(b + 1) * per_rank]
    fsdp.train_step(loss_fn, {k: v[idx] for k, v in data.items()})
    if step == 4 and ((attempt == "0" and os.environ["GROUP_RANK"] == "2")
                      if "ELASTIC_KILLME" not in os.environ
                      else os.environ["ELASTIC_KILLME"] == "1" and n == 3):
        print("KILLME", flush=True)
        while True:
            time.sleep(1)
    if (step + 1) % 2 == 0:
        jfsdp.save_checkpoint(ckpt_dir, fsdp, data_state={"step": step + 1}, async_save=True)
    print(f"step {step} done", flush=True)
params = fsdp.full_params()
if rank == 0:
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    np.savez(out_path, **{jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves})
jaxpg.destroy_process_group()  # waits for the last asynchronous checkpoint
print("DONE", flush=True)
