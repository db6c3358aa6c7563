"""Driver side of the multi-process pipeline benchmarks (``bench/pipeline_efficiency.py``,
``bench/pipeline_vs_torch.py``): the single-process reference gradients and the launch of
``bench/_pipeline_mp_worker.py`` under ``jaxpg-run``.

Import this module before JAX: it asks for ``p`` simulated CPU devices in this process
(for the reference) and starts the workers without that flag (one device each).
"""

from __future__ import annotations

import os
from pathlib import Path

from _launch import BENCH, free_port
from _launch import launch as _launch

WORKER = BENCH / "_pipeline_mp_worker.py"
# the workers do not inherit this flag (bench/_launch.py drops it): one device each
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def single_process_reference(path, schedules, p, m, blocks, dim, microbatch) -> None:
    """Writes to ``path`` (npz) the gradients of every schedule's pipeline step on ``p``
    simulated devices in this one process, keys ``"<schedule> m=<m> <param>"``, each
    ``[blocks, ...]``: what the multi-process workers must reproduce."""
    import jax
    import numpy as np
    from _pipeline_mp_worker import CHUNKS, jaxpg_step, make_batch, make_params, staged, unstaged
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:p]), ("pp",))
    params = make_params(blocks, dim)
    x, t = make_batch(m * microbatch, dim)
    out = {}
    for name in schedules:
        v = CHUNKS[name]
        _, grads = jaxpg_step(name, mesh, m, blocks // (p * v))(staged(params, p * v), x, t)
        for k, a in unstaged(grads).items():
            out[f"{name} m={m} {k}"] = a
    np.savez(path, **out)


def launch(nproc: int, worker_args: list[str], timeout: int = 3000,
           worker: Path = WORKER) -> None:
    """Runs ``worker`` (default ``_pipeline_mp_worker.py``) as ``nproc`` processes under
    ``jaxpg-run`` (each pinned to its own core when there are enough, several to a core
    round-robin when not), streaming rank 0's output; raises on failure."""
    args = ["--torch-port", free_port(), *worker_args]
    print(f"jaxpg.run --nproc-per-node {nproc} {worker.name} {' '.join(map(str, args))}",
          flush=True)
    _launch(worker, args, nproc=nproc, launcher_args=["--local-ranks-filter", "0"],
            timeout=timeout, capture=False)
