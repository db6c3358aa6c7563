"""Worker: a world started without the launcher (rank 0 hosts the service) loses a rank.

    coordinator_loss.py RANK WORLD PORT CASE [TIMEOUT_S]

Every rank runs one all_reduce (the world works), then CASE:

* ``killbefore``: rank 0 dies (SIGKILL) before the second all_reduce;
* ``killduring``: rank 0 waits 1 s (the others are inside the second all_reduce), then dies;
* ``stop``: rank 0 SIGSTOPs itself before the second all_reduce;
* ``raise``: rank 1 raises before the second all_reduce (a Python error, exit code 1);
* ``storeget``: every rank makes a DDP, then rank 1 dies (SIGKILL); the others wait in
  ``TCPStore.get`` for a key only rank 1 would set (store timeout 300 s): ``wait`` and
  ``multi_get``, then ``new_group`` and ``save_checkpoint`` (each caught), then, once every
  survivor got there (files in ``$JAXPG_TEST_HANDSHAKE_DIR``), ``get``, instead of the
  second all_reduce;
* ``exit3``: rank 1 SIGSTOPs itself; rank 0 catches the second all_reduce's error (its
  collective thread stays stuck in XLA) and calls ``sys.exit(3)``;
* ``none``: no fault.

The survivors' second all_reduce raises (uncaught: the process ends with the message and
exit code 1). A rank that gets through prints ``DONE <sum>``. Rank 0 prints
``SERVICE_PID <pid>`` (its coordination-service child) first.
"""

import datetime
import os
import signal
import sys
import time

import jax.numpy as jnp

import jaxpg
from jaxpg.runtime import coordinator_process

rank, world, port, case = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
timeout = float(sys.argv[5]) if len(sys.argv) > 5 else 20.0
jaxpg.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                         world_size=world, timeout=datetime.timedelta(seconds=timeout))
if rank == 0 and coordinator_process.running() is not None:
    print(f"SERVICE_PID {coordinator_process.running().pid}", flush=True)
x = jnp.ones(4) * (rank + 1)
jaxpg.all_reduce(x)
print(f"READY {rank}", flush=True)
if rank == 0 and case in ("killbefore", "killduring"):
    time.sleep(1.0 if case == "killduring" else 0.0)
    os.kill(os.getpid(), signal.SIGKILL)
if rank == 0 and case == "stop":
    os.kill(os.getpid(), signal.SIGSTOP)
if rank == 1 and case == "raise":
    raise RuntimeError("rank 1 fails on purpose")
if case == "exit3":
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    try:
        jaxpg.all_reduce(jnp.ones(4))
    except jaxpg.DistNetworkError as err:
        print(f"CAUGHT {type(err).__name__}: {err}", flush=True)
        sys.exit(3)
if case == "storeget":
    import tempfile

    import optax
    from flax import nnx

    from jaxpg.ddp import DistributedDataParallel, save_checkpoint

    ddp = DistributedDataParallel(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    store = jaxpg.TCPStore(timeout=300, namespace="user")
    scratch = tempfile.TemporaryDirectory()  # removed at exit; nothing is written into it
    for name, call in (("wait", lambda: store.wait(["set by rank 1"])),
                       ("multi_get", lambda: store.multi_get(["set by rank 1"])),
                       ("new_group", lambda: jaxpg.new_group([0, 2])),
                       ("save_checkpoint", lambda: save_checkpoint(scratch.name, ddp))):
        try:
            call()
        except jaxpg.DistNetworkError as err:
            print(f"CAUGHT {name} DistNetworkError: {err}", flush=True)
    # The survivors end together: one that ran through its calls first and exited would
    # be lost too by the time a slower one (a loaded machine) first asks who is.
    handshake = os.environ["JAXPG_TEST_HANDSHAKE_DIR"]
    open(os.path.join(handshake, f"done{rank}"), "w").close()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(handshake, f"done{r}")) for r in range(world) if r != 1):
        time.sleep(0.05)
    store.get("set by rank 1")
y = jaxpg.all_reduce(jnp.ones(4) * (rank + 1))
print(f"DONE {float(y[0])}", flush=True)
jaxpg.destroy_process_group()
