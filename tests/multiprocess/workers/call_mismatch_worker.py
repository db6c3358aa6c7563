"""Two ranks that disagree (``JAXPG_TEST_CASE``), without JAXPG_DEBUG=DETAIL:

* ``shapes``: rank 0 all-reduces 3 floats, rank 1 four, then both call ``barrier()``;
* ``checkpoint``: rank 0 calls ``save_checkpoint`` (torch's ``if rank == 0:`` habit),
  rank 1 calls ``barrier()``; then rank 0 alone calls ``new_group([0, 1])`` with a 2 s
  timeout and prints ``NEW_GROUP ERROR <type>: <text>`` (none: ``NEW_GROUP NO ERROR``).

* ``desync`` (the default signature check): a series of calls that differ across the ranks
  (shapes 3 against 4 and 4 against 8, dtypes, reduce ops, a cached call against a new one,
  recorded steps of other names or shapes), each followed by calls that agree, then rank 1
  exits while rank 0 waits in a recorded step; each rank prints ``CASE <name> ERROR <type>:
  <text>`` or ``CASE <name> RESULT <values>`` per call.

Each rank prints ``ERROR <type>: <text>`` for the error it gets (none: ``NO ERROR``)."""

import datetime
import os
import sys
import time

import numpy as np

import jaxpg

jaxpg.init_process_group(timeout=datetime.timedelta(seconds=float(sys.argv[2])))
rank = jaxpg.get_rank()


def _desync_cases() -> None:
    import jax
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    def run(name, fn):
        try:
            out = fn()
            print(f"CASE {name} RESULT {np.asarray(out).ravel().tolist()}", flush=True)
        except Exception as err:  # noqa: BLE001 (printed for the test)
            print(f"CASE {name} ERROR {type(err).__name__}: {' '.join(str(err).split())}",
                  flush=True)

    def ones(n, dtype=np.float32):
        return np.ones(n, dtype)

    run("shape_3_4", lambda: jaxpg.all_reduce(ones(3 if rank == 0 else 4)))
    run("shape_4_8", lambda: jaxpg.all_reduce(ones(4 if rank == 0 else 8)))
    run("dtype", lambda: jaxpg.all_reduce(ones(4, np.float32 if rank == 0 else np.int32)))
    run("op", lambda: jaxpg.all_reduce(ones(4), op=jaxpg.ReduceOp.SUM if rank == 0
                                       else jaxpg.ReduceOp.MAX))
    run("warm", lambda: jaxpg.all_reduce(ones(5) * (rank + 1)))
    # rank 0's call is compiled and cached, rank 1's is new
    run("cache_hit", lambda: jaxpg.all_reduce(ones(5 if rank == 0 else 6)))
    run("after", lambda: jaxpg.all_reduce(np.full(2, rank + 1, np.float32)))

    mesh = Mesh(np.array(jax.devices()), ("i",))
    sharding = NamedSharding(mesh, P("i"))

    def step(name, scale):
        def body(b):
            return lax.psum(b * scale, "i")

        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P()))
        return jaxpg.supervision.recorded_step(fn, mesh, name=name)

    train, evaluate = step("train_step", 1.0), step("eval_step", 2.0)

    def batch(n):
        return jax.make_array_from_process_local_data(
            sharding, np.full(n, rank + 1, np.float32), (2 * n,))

    x = batch(2)
    run("step_warm", lambda: train(x))
    run("step_name", lambda: (train if rank == 0 else evaluate)(x))
    run("step_shapes", lambda: train(x if rank == 0 else batch(3)))
    run("step_after", lambda: train(x))
    entering = os.path.join(sys.argv[1], "desync_entering")
    if rank == 1:  # leave while rank 0 waits in its next step: its gloo receive fails
        deadline = time.monotonic() + 60
        while not os.path.exists(entering) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.5)
        os._exit(0)
    open(entering, "w").close()
    run("gloo_failure", lambda: train(x))
    os._exit(0)


if os.environ["JAXPG_TEST_CASE"] == "desync":
    _desync_cases()
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
