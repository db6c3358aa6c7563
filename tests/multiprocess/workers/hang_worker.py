"""Named hangs and the flight recorder across 3 processes (tests/multiprocess/test_hangs_mp.py).

    hang_worker.py SCENARIO        (env:// variables, JAXPG_FR_BUFFER_SIZE, JAXPG_FR_DUMP_DIR)

The world starts with a long timeout (a short one would also bound jax.distributed's
start-up, which a loaded machine can miss); the scenario runs on a group of every rank with
a timeout of TEST_TIMEOUT_S (4 s). Every rank first runs one all_reduce on it. Then:

* ``uneven``: DDP on an ``nnx.Linear``; ranks 0 and 2 run 4 train_steps, rank 1 runs 3
  (it has one batch fewer), then every rank calls ``barrier()``;
* ``desync``: rank 1 calls ``all_gather_into_tensor`` where the others call ``all_reduce``
  (before it, rank 2 dumps on SIGUSR1 and rank 0 calls
  ``jaxpg.supervision.dump_flight_recorder``);
* ``stop``: a ``jaxpg.spmd`` step; on its third launch rank 1 SIGSTOPs itself inside it;
* ``kill``: the same, but rank 1 SIGKILLs itself inside the step.

A rank whose call raises prints ``ERROR <class>: <message>``; the survivors then wait for
each other (so every live rank has dumped) and leave, rank 0 (which hosts the coordination
service) last.
"""

import datetime
import os
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpg
from jaxpg.supervision.fr_dump import read_dump

scenario = sys.argv[1]
jaxpg.init_process_group(timeout=datetime.timedelta(seconds=120))
rank, n = jaxpg.get_rank(), jaxpg.get_world_size()
group = jaxpg.new_group(list(range(n)), timeout=datetime.timedelta(
    seconds=float(os.environ.get("TEST_TIMEOUT_S", "4"))))
survivors = n - (1 if scenario in ("stop", "kill") else 0)


def say(text: str) -> None:
    print(f"[rank {rank}] {text}", flush=True)


def ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie has too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] in "ZX"
    except FileNotFoundError:
        return True


def uneven() -> None:
    import optax
    from flax import nnx

    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    ddp = jaxpg.ddp.DistributedDataParallel(model, optax.sgd(0.1), group=group)

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    batches = 3 if rank == 1 else 4  # rank 1's data runs out one step early
    for step in range(batches):
        x = np.full((2, 4), step + rank, np.float32)
        ddp.train_step(loss_fn, {"x": x, "y": np.zeros((2, 2), np.float32)})
        say(f"STEP {step} done")
    jaxpg.barrier(group)


def desync() -> None:
    dumps = os.environ["JAXPG_FR_DUMP_DIR"]
    if rank == 2:  # SIGUSR1 dumps, from the recorder's thread
        os.kill(os.getpid(), signal.SIGUSR1)
        mine = os.path.join(dumps, "jaxpg_fr_rank_2")
        deadline = time.monotonic() + 30

        def dumped() -> bool:
            if not os.path.exists(mine):
                return False
            with open(mine) as f:
                return '"trigger": "SIGUSR1"' in f.readline()

        while time.monotonic() < deadline and not dumped():
            time.sleep(0.05)
        say(f"USR1 dumped: {os.path.exists(mine)}")
    if rank == 0:
        manual = os.path.join(os.path.dirname(dumps), "manual_0")
        path = jaxpg.supervision.dump_flight_recorder(manual)
        say(f"MANUAL dump at {path}")
    if rank == 1:
        jaxpg.all_gather_into_tensor(np.ones(4, np.float32), group=group)
    else:
        jaxpg.all_reduce(np.ones(4, np.float32), group=group)


def faulty_step(sig: int) -> None:
    launches = []

    def fault_hook(x):
        launches.append(1)
        if rank == 1 and len(launches) == 3:
            say("FAULT inside the step")
            # to this thread, not the process: os.kill(getpid()) hands SIGSTOP to the main
            # thread (waiting for the step), and this one runs on until that thread stops
            # the process; meanwhile the step's all_reduce could complete with the peers,
            # who then time out one step later. A thread's own stop signal stops it first.
            signal.pthread_kill(threading.get_ident(), sig)
        return np.float32(0)

    def step(x):
        y = io_callback(fault_hook, jax.ShapeDtypeStruct((), jnp.float32), x.sum())
        return jaxpg.all_reduce(x + y, group=group)

    step = jaxpg.spmd(step, group=group)
    sharding = NamedSharding(group.mesh, P(group.axis_name))
    x = jax.make_array_from_process_local_data(sharding, np.ones((1, 4), np.float32), (n, 4))
    for i in range(4):
        out = step(x)
        say(f"STEP {i} sum {float(np.asarray(out.addressable_data(0)).sum())}")


jaxpg.all_reduce(np.ones(2, np.float32), group=group)
say("READY")
try:
    {"uneven": uneven, "desync": desync, "stop": lambda: faulty_step(signal.SIGSTOP),
     "kill": lambda: faulty_step(signal.SIGKILL)}[scenario]()
    say("NO ERROR")
except jaxpg.DistError as err:
    say(f"ERROR {type(err).__name__}: {err}")

# Leave only once every survivor has reported and every live rank's dump is complete (a
# peer's dump request is answered from the recorder's thread); rank 0 hosts the coordination
# service, so it leaves last, once the others' processes have ended.
store = jaxpg.GroupMember.WORLD.store
store.set(f"pid{rank}", str(os.getpid()))
store.add("reported", 1)
deadline = time.monotonic() + 60
while int(store.add("reported", 0)) < survivors and time.monotonic() < deadline:
    time.sleep(0.05)
live = [r for r in range(n) if not (scenario in ("stop", "kill") and r == 1)]


def dumped(r: int) -> bool:
    path = os.path.join(os.environ["JAXPG_FR_DUMP_DIR"], f"jaxpg_fr_rank_{r}")
    try:
        return not read_dump(path).partial
    except (OSError, ValueError):
        return False


while not all(dumped(r) for r in live) and time.monotonic() < deadline:
    time.sleep(0.05)
if rank != 0:
    os._exit(0)
others = [int(store.get(f"pid{r}")) for r in live if r != 0]
while not all(ended(pid) for pid in others) and time.monotonic() < deadline:
    time.sleep(0.05)
os._exit(0)
