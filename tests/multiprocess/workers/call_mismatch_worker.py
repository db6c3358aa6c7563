"""Two ranks that disagree (``JAXPG_TEST_CASE``), without JAXPG_DEBUG=DETAIL:

* ``shapes``: rank 0 all-reduces 3 floats, rank 1 four, then both call ``barrier()``;
* ``checkpoint``: rank 0 calls ``save_checkpoint`` (torch's ``if rank == 0:`` habit),
  rank 1 calls ``barrier()``; then rank 0 alone calls ``new_group([0, 1])`` with a 2 s
  timeout and prints ``NEW_GROUP ERROR <type>: <text>`` (none: ``NEW_GROUP NO ERROR``).

Each rank prints ``ERROR <type>: <text>`` for the error it gets (none: ``NO ERROR``)."""

import datetime
import os
import sys
import time

import numpy as np

import jaxpg

jaxpg.init_process_group(timeout=datetime.timedelta(seconds=float(sys.argv[2])))
rank = jaxpg.get_rank()
try:
    if os.environ["JAXPG_TEST_CASE"] == "shapes":
        jaxpg.all_reduce(np.ones(3 if rank == 0 else 4, np.float32))
        jaxpg.barrier()
    else:
        import optax
        from flax import nnx

        from jaxpg.ddp import DistributedDataParallel, save_checkpoint

        ddp = DistributedDataParallel(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1))
        if rank == 0:
            save_checkpoint(sys.argv[1], ddp)
        else:
            jaxpg.barrier()
    print("NO ERROR", flush=True)
except Exception as err:  # noqa: BLE001 (printed for the test)
    print(f"ERROR {type(err).__name__}: {' '.join(str(err).split())}", flush=True)
if os.environ["JAXPG_TEST_CASE"] == "checkpoint" and rank == 0:
    try:  # rank 1 never calls it: the creation's store barrier times out
        jaxpg.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
        print("NEW_GROUP NO ERROR", flush=True)
    except Exception as err:  # noqa: BLE001 (printed for the test)
        print(f"NEW_GROUP ERROR {type(err).__name__}: {' '.join(str(err).split())}", flush=True)
# leave only once both ranks have their answer (a peer that left would change the other's)
done = os.path.join(sys.argv[1], f"done_{rank}")
open(done, "w").close()
deadline = time.monotonic() + 120
while not all(os.path.exists(os.path.join(sys.argv[1], f"done_{r}")) for r in (0, 1)):
    if time.monotonic() > deadline:
        break
    time.sleep(0.05)
os._exit(0)  # a collective that timed out holds the runner thread
