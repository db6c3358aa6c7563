"""Worker for the launcher's stops: ``train [FAIL_RANK]`` runs a loop of all_reduces through
jaxpg (rank FAIL_RANK raises ``ValueError('bad batch')`` at step 5; the others go on);
``own_init SLEEP`` calls ``jax.distributed.initialize`` itself, then rank 1 raises on the
first attempt while rank 0 sleeps SLEEP seconds (a later attempt ends at once)."""

import os
import sys
import time

print(f"started pid={os.getpid()}", flush=True)
rank = int(os.environ["RANK"])

if sys.argv[1] == "train":
    import numpy as np

    import jaxpg

    jaxpg.init_process_group()
    fail_rank = int(sys.argv[2]) if len(sys.argv) > 2 else -1
    print("training", flush=True)
    for step in range(10**6):
        jaxpg.all_reduce(np.ones(4, np.float32))
        if step == 5 and rank == fail_rank:
            raise ValueError("bad batch")
        time.sleep(0.01)
else:
    import jax

    jax.distributed.initialize(f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                               int(os.environ["WORLD_SIZE"]), rank)
    first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
    print(f"initialized attempt={os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
    if first and rank == 1:
        raise RuntimeError("rank 1 fails")
    if first:
        time.sleep(float(sys.argv[2]))
    print("DONE", flush=True)
