"""A 2-process pipeline step (one or two CPU devices per process, ppermute over gloo).

Run by ``jaxpg-run`` from ``tests/multiprocess/test_pipeline_mp.py``; rank 0 writes each
schedule's loss and gathered gradients to ``argv[1]`` (npz). The model and data are
defined here and imported by the test for its single-process reference.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

SCHEDULES = {"1f1b": 1, "zb_v": 2}  # name -> chunks per rank (V: stages r, 2p - 1 - r)
BLOCKS, DIM, M, ROWS = 8, 16, 4, 8  # blocks, width, microbatches, rows per microbatch


def stage(w, x):
    for i in range(w["w1"].shape[0]):
        x = x + jnp.tanh(x @ w["w1"][i] + w["b1"][i]) @ w["w2"][i]
    return x


def mse(_, y, t):
    return jnp.mean((y - t) ** 2)


def data():
    """``(params [BLOCKS, ...], x, t)``, the same in every process."""
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(BLOCKS, DIM, 2 * DIM)) / np.sqrt(DIM),
        "b1": rng.normal(size=(BLOCKS, 2 * DIM)) * 0.1,
        "w2": rng.normal(size=(BLOCKS, 2 * DIM, DIM)) / np.sqrt(2 * DIM),
    }
    x, t = rng.normal(size=(2, M * ROWS, DIM))
    as32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    return jax.tree.map(as32, params), as32(x), as32(t)


def staged(params, stages):
    return {k: a.reshape(stages, -1, *a.shape[1:]) for k, a in params.items()}


def run(mesh, name):
    """``(loss, grads [BLOCKS, ...])`` of schedule ``name`` on ``mesh``."""
    from jaxpg.pipeline import pipeline_value_and_grad

    params, x, t = data()
    stages = mesh.shape["pp"] * SCHEDULES[name]
    step = jax.jit(lambda p, x, t: pipeline_value_and_grad(
        stage, mse, p, x, t, mesh=mesh, schedule=name, num_microbatches=M))  # fmt: skip
    return step(staged(params, stages), x, t)


def main() -> None:
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    import jaxpg

    jaxpg.init_process_group()
    assert jax.process_count() == 2 and len(jax.local_devices()) in (1, 2), jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("pp",))  # with 2 devices each: 2 stages a process
    out = {}
    for name in SCHEDULES:
        loss, grads = run(mesh, name)
        grads = multihost_utils.process_allgather(grads, tiled=True)
        out[f"{name} loss"] = np.asarray(loss)
        for k, a in grads.items():
            out[f"{name} {k}"] = np.asarray(a).reshape(BLOCKS, *a.shape[2:])
    if jaxpg.get_rank() == 0:
        np.savez(sys.argv[1], **out)
    jaxpg.barrier()
    jaxpg.destroy_process_group()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
