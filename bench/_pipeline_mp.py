"""Driver side of the multi-process pipeline benchmarks (``bench/pipeline_efficiency.py``,
``bench/pipeline_vs_torch.py``): the single-process reference gradients and the launch of
``bench/_pipeline_mp_worker.py`` under ``jaxpg-run``.

Import this module before JAX: it asks for ``p`` simulated CPU devices in this process
(for the reference) and starts the workers without that flag (one device each).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "bench" / "_pipeline_mp_worker.py"
_WORKER_ENV = dict(os.environ)  # before the flag below: the workers get their own devices
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def single_process_reference(path, schedules, p, m, blocks, dim, microbatch) -> None:
    """Writes to ``path`` (npz) the gradients of every schedule's pipeline step on ``p``
    simulated devices in this one process, keys ``"<schedule> m=<m> <param>"``, each
    ``[blocks, ...]``: what the multi-process workers must reproduce."""
    import jax
    import numpy as np
    from _pipeline_mp_worker import CHUNKS, jaxpg_step, make_batch, make_params, staged
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:p]), ("pp",))
    params = make_params(blocks, dim)
    x, t = make_batch(m * microbatch, dim)
    out = {}
    for name in schedules:
        v = CHUNKS[name]
        _, grads = jaxpg_step(name, mesh, m, blocks // (p * v))(staged(params, p * v), x, t)
        for k, a in grads.items():
            out[f"{name} m={m} {k}"] = np.asarray(a).reshape(blocks, *a.shape[2:])
    np.savez(path, **out)


def launch(nproc: int, worker_args: list[str], timeout: int = 3000,
           worker: Path = WORKER) -> None:
    """Runs ``worker`` (default ``_pipeline_mp_worker.py``) as ``nproc`` processes under
    ``jaxpg-run`` (each pinned to its own core when there are enough, several to a core
    round-robin when not), streaming rank 0's output; raises on failure."""
    env = dict(_WORKER_ENV)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    cmd = [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", str(nproc),
           "--local-ranks-filter", "0", str(worker), "--torch-port", str(free_port()),
           *worker_args]  # fmt: skip
    print(" ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, timeout=timeout)
