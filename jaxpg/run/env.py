"""The environment each worker starts with: torchrun's variables and its devices."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

__all__ = ["AFFINITY_VAR", "cpu_slice", "visible_gpus", "worker_env"]

AFFINITY_VAR = "JAXPG_CPU_AFFINITY"
"""The CPUs (``"0,1"``) the launcher pins a CPU worker to, or ``none`` to leave it unpinned."""

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")
_GLIBC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"


def visible_gpus() -> list[str]:
    """The NVIDIA GPUs this launcher may hand out (honours CUDA_VISIBLE_DEVICES)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    try:
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []


def cpu_slice(local_rank: int, local_world_size: int, cpus: Sequence[int]) -> list[int]:
    """This local rank's share of ``cpus``: contiguous equal slices, or one CPU, shared
    round-robin, when there are fewer CPUs than workers."""
    cpus = sorted(cpus)
    if len(cpus) < local_world_size:
        return [cpus[local_rank % len(cpus)]]
    per = len(cpus) // local_world_size
    return cpus[local_rank * per : (local_rank + 1) * per]


def _cpu_threads(env: dict[str, str], local_rank: int, local_world_size: int) -> None:
    """Per-worker thread settings of a CPU worker; the user's settings win.

    XLA:CPU sizes its intra-op thread pool from the CPUs the process may run on; in jax
    0.10.2 neither ``OMP_NUM_THREADS`` nor ``--xla_cpu_multi_thread_eigen=false`` changes
    it (docs/design.md, "CPU all_reduce: where the time goes"). So the launcher pins each
    worker to its slice of the CPUs (applied in the child before exec) and sets
    ``OMP_NUM_THREADS`` to the slice's size for torch/numpy/BLAS code in the worker, as
    torchrun sets it for its workers.
    """
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    mine = cpu_slice(local_rank, local_world_size, cpus)
    env.setdefault("OMP_NUM_THREADS", str(len(mine)))
    if env.get(AFFINITY_VAR) is None and local_world_size > 1:
        env[AFFINITY_VAR] = ",".join(map(str, mine))
    affinity_of(env)  # a bad user value fails here, before any worker starts


def affinity_of(env: dict[str, str]) -> list[int] | None:
    """The CPUs ``env`` asks the worker to be pinned to (None: leave it unpinned).

    Raises:
        ValueError: ``JAXPG_CPU_AFFINITY`` is neither ``none`` nor a list of CPU numbers.
    """
    value = env.get(AFFINITY_VAR, "").strip()
    if not value or value.lower() == "none":
        return None
    try:
        return [int(c) for c in value.split(",") if c.strip()]
    except ValueError:
        raise ValueError(
            f"{AFFINITY_VAR}={value!r}: expected CPU numbers like '0,1' or 'none' "
            "(to leave the workers unpinned)"
        ) from None


def worker_env(
    base: dict[str, str],
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
    devices_per_proc: int = 1,
    gpus: Sequence[str] = (),
    nnodes: int = 1,
    restart_count: int = 0,
    max_restarts: int = 0,
    run_id: str = "none",
    coordinator_hosted: bool = False,
) -> dict[str, str]:
    """The environment of one worker: ``base`` plus the launcher's variables.

    Args:
        base: the launcher's environment.
        rank: the worker's global rank.
        local_rank: the worker's index on this node.
        world_size: the number of workers in the job.
        local_world_size: the number of workers on this node.
        node_rank: this node's index.
        master_addr: the coordinator's host.
        master_port: the coordinator's port (this attempt's).
        devices_per_proc: how many devices each worker gets.
        gpus: the GPU ids to share out; empty on a machine without GPUs.
        nnodes: the number of nodes.
        restart_count: how many times the group has been restarted so far.
        max_restarts: ``--max-restarts``.
        run_id: the job's id (``--rdzv-id``), the same on every node and attempt.
        coordinator_hosted: the launcher hosts JAX's coordination service at
            ``master_addr:master_port``, so that rank 0 connects to it as a client only.
    """
    env = dict(base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(local_world_size),
        GROUP_RANK=str(node_rank),
        GROUP_WORLD_SIZE=str(nnodes),
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(world_size),
        ROLE_NAME="default",
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        TORCHELASTIC_RESTART_COUNT=str(restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(max_restarts),
        TORCHELASTIC_RUN_ID=run_id,
        JAXPG_DEVICES_PER_PROC=str(devices_per_proc),
        PYTHONUNBUFFERED="1",
    )
    if coordinator_hosted:
        env["JAXPG_COORDINATOR_HOSTED"] = f"{master_addr}:{master_port}"
    else:
        env.pop("JAXPG_COORDINATOR_HOSTED", None)
    flags = _DEVICE_COUNT_FLAG.sub("", env.get("XLA_FLAGS", "")).split()
    flags.append(f"--xla_force_host_platform_device_count={devices_per_proc}")
    env["XLA_FLAGS"] = " ".join(flags)
    if "JAX_NUM_CPU_DEVICES" in env:
        env["JAX_NUM_CPU_DEVICES"] = str(devices_per_proc)
    if gpus:
        start = local_rank * devices_per_proc
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[start : start + devices_per_proc])
    else:
        # XLA's CPU collectives allocate a fresh output buffer per call; with glibc's default
        # thresholds every large one is a new mmap and pays its page faults again. Keeping
        # big blocks in the heap makes large reduce_scatters faster (docs/design.md;
        # bench/results/collectives_mp.json, allocator_experiment). The user's setting wins.
        env.setdefault("GLIBC_TUNABLES", _GLIBC_TUNABLES)
        _cpu_threads(env, local_rank, local_world_size)
    return env
