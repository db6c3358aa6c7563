"""Worker: the process executor (one pipeline rank per process) across WORLD processes.

    pipeline_mpmd_worker.py RANK WORLD PORT CASE OUT

Started by ``tests/multiprocess/test_pipeline_mpmd.py`` as plain processes (rank 0 hosts
the coordination service), one CPU device each. CASE:

* ``grads``: every schedule in both remat modes on a pipeline of all WORLD processes
  (``executor="mpmd"``); with WORLD = 2 also the SPMD executor (``jax.jit``, lockstep over
  gloo) without remat; with WORLD = 4 two ``make_train_step`` steps on a dp = 2 x pp = 2
  mesh with DDP's bucketed reducer. Rank 0 writes every loss and gathered gradient to OUT (npz).
* ``kill``: after a good step, rank 1 dies (SIGKILL) before the next;
* ``stop``: after a good step, rank 1 SIGSTOPs itself (heartbeat timeout 10 s);
* ``timeout``: as ``stop``, with a 3 s group timeout and a 60 s heartbeat timeout;
* ``meta``: rank 1 runs microbatches of another size than rank 0's.

In the fault cases each surviving rank prints ``CAUGHT <error type>: <message>`` and ends.
The model and data are defined here and imported by the test for its references.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np

D, D_IN, D_OUT, M, ROWS = 8, 3, 2, 4, 2
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 1, "zb_v": 2,
             "looped_bfs": 2, "dualpipe_v": 2}


def schedules(world: int) -> dict[str, int]:
    """The schedules (name: chunks per rank) a pipeline of ``world`` ranks runs at ``M``
    microbatches: all but DualPipeV where it would need more (``2 world``)."""
    return {name: v for name, v in SCHEDULES.items() if name != "dualpipe_v" or M >= 2 * world}


def block(w, x):
    return x + jnp.tanh(x @ w["w"] + w["b"])


def embed(e, x):
    return x @ e


def head_loss(h, y, t):
    return jnp.mean((y @ h - t) ** 2)


def model(p, v, seed=0):
    """``StagedParams`` of ``p * v`` one-block stages (model order), as numpy arrays."""
    from jaxpg.pipeline import StagedParams

    rng = np.random.default_rng(seed)
    n = p * v
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    return StagedParams(
        {"w": f32(rng.normal(size=(n, D, D)) * 0.4), "b": f32(rng.normal(size=(n, D)) * 0.1)},
        f32(rng.normal(size=(D_IN, D))), f32(rng.normal(size=(D, D_OUT))),
    )  # fmt: skip


def batch(size, seed=1):
    rng = np.random.default_rng(seed)
    return (np.asarray(rng.normal(size=(size, D_IN)), np.float32),
            np.asarray(rng.normal(size=(size, D_OUT)), np.float32))  # fmt: skip


def reference(params, x, t):
    """Loss and gradients of the un-pipelined model on the whole batch."""

    def loss(sp):
        h = embed(sp.first, x)
        for s in range(sp.stages["w"].shape[0]):
            h = block(jax.tree.map(lambda a, s=s: a[s], sp.stages), h)
        return head_loss(sp.last, h, t)

    return jax.value_and_grad(loss)(params)


def _gather(tree):
    from jax.experimental import multihost_utils

    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def grads_case(rank, world, out_path):
    from jax.sharding import Mesh

    import jaxpg
    from jaxpg.pipeline import pipeline_value_and_grad

    mesh = Mesh(np.array(jax.devices()), ("pp",))
    x, t = batch(M * ROWS)
    out = {}
    for name, v in schedules(world).items():
        params = model(world, v)
        runs = [(False, "mpmd"), (True, "mpmd")] + [(False, "spmd")] * (world == 2)
        for remat, executor in runs:

            def step(sp, x, t, executor=executor, remat=remat, name=name):
                return pipeline_value_and_grad(
                    block, head_loss, sp, x, t, mesh=mesh, schedule=name, num_microbatches=M,
                    first_fn=embed, remat=remat, executor=executor)  # fmt: skip

            run = jax.jit(step) if executor == "spmd" else step
            loss, grads = run(params, x, t)
            if executor == "mpmd":  # a second step reuses lanes, programs and buffers
                loss, grads = run(params, x, t)
            tag = f"{name} {executor} remat={remat}"
            out[f"{tag} loss"] = np.asarray(_gather(loss))
            for k, a in _gather(grads.stages).items():
                out[f"{tag} stages.{k}"] = a
            out[f"{tag} first"] = _gather(grads.first)
            out[f"{tag} last"] = _gather(grads.last)
    if world == 4:
        out.update(train_case())
    if rank == 0:
        np.savez(out_path, **out)
    jaxpg.barrier()
    jaxpg.destroy_process_group()
    print("DONE", flush=True)


def train_case():
    """Two optimizer steps of 1F1B on dp = 2 x pp = 2 with DDP's bucketed reducer."""
    import optax

    import jaxpg
    from jaxpg.pipeline import init_train_state, make_train_step
    from jaxpg.pipeline.dp_grad_reducer import bucketed_grad_reducer

    mesh = jaxpg.ParallelDims(dp_replicate=2, pp=2)  # replicas: processes (0, 1), (2, 3)
    params = model(2, 1, seed=2)
    optimizer = optax.sgd(0.1)
    placed, opt_state = init_train_state(params, optimizer, mesh)
    step = make_train_step(block, head_loss, optimizer, mesh=mesh, schedule="1f1b",
                           num_microbatches=M, first_fn=embed,
                           grad_reducer=bucketed_grad_reducer(
                               params, 2, dp_axis=mesh.axis("dp_replicate")))  # fmt: skip
    out = {}
    for i in range(2):
        x, t = batch(2 * M * ROWS, seed=10 + i)
        placed, opt_state, loss = step(placed, opt_state, x, t)
        out[f"train loss {i}"] = np.asarray(_gather(loss))
    for k, a in _gather(placed.stages).items():
        out[f"train stages.{k}"] = a
    out["train first"] = _gather(placed.first)
    out["train last"] = _gather(placed.last)
    return out


def fault_case(rank, case):
    from jax.sharding import Mesh

    import jaxpg
    from jaxpg.pipeline import pipeline_value_and_grad

    mesh = Mesh(np.array(jax.devices()), ("pp",))
    params = model(2, 1)
    rows = ROWS + (1 if case == "meta" and rank == 1 else 0)
    x, t = batch(M * rows)

    def step():
        loss, _ = pipeline_value_and_grad(block, head_loss, params, x, t, mesh=mesh,
                                          schedule="1f1b", num_microbatches=M,
                                          first_fn=embed, executor="mpmd")  # fmt: skip
        return float(np.asarray(loss.addressable_shards[0].data))

    try:
        if case != "meta":
            step()
            print(f"STEP OK {rank}", flush=True)
            if case == "timeout":  # the short group timeout only after the good step: the
                from jaxpg.groups import world as world_state  # first compiles (slow under load)

                world_state.current().timeout = datetime.timedelta(seconds=3)
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL if case == "kill" else signal.SIGSTOP)
        step()
    except (jaxpg.DistNetworkError, jaxpg.DistTimeoutError, ValueError) as err:
        print(f"CAUGHT {type(err).__name__}: {err}", flush=True)
        os._exit(0)  # a lane may stay stuck in the collective with the stopped peer
    print("NOT CAUGHT", flush=True)
    os._exit(1)


def main() -> None:
    rank, world, port, case, out_path = (int(sys.argv[1]), int(sys.argv[2]),
                                         int(sys.argv[3]), sys.argv[4], sys.argv[5])
    import jaxpg

    jaxpg.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=world, timeout=datetime.timedelta(seconds=120))
    assert len(jax.local_devices()) == 1, jax.local_devices()
    if case == "grads":
        grads_case(rank, world, out_path)
    else:
        fault_case(rank, case)


if __name__ == "__main__":
    main()
