"""Joining a coordination service that someone else hosts (``jaxpg-run``'s launcher).

``jax.distributed.initialize`` makes process 0 host JAX's coordination service, so when
process 0 dies the service dies with it and JAX's agents in every other process end them
with a C++ fatal error. ``jaxpg-run`` hosts the service in the launcher instead and tells the
workers through ``JAXPG_COORDINATOR_HOSTED=<host:port>``; :func:`connect` then starts
``jax.distributed`` in every process, process 0 included, as a client only. Afterwards
``jax.distributed`` is in the same state as after ``initialize`` (``jax.process_index()``,
the CPU client's gloo collectives, ``jax.distributed.shutdown()`` all work as usual).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["connect", "hosted_address"]

ENV_VAR = "JAXPG_COORDINATOR_HOSTED"


def hosted_address() -> str | None:
    """The address of a launcher-hosted coordination service, if the launcher set one."""
    return os.environ.get(ENV_VAR) or None


def connect(
    address: str,
    process_id: int,
    num_processes: int,
    *,
    init_timeout: int,
    heartbeat_timeout: int,
    local_device_ids: Sequence[int] | None = None,
    shutdown_timeout: int = 300,
) -> None:
    """Starts ``jax.distributed`` as a client of the service at ``address`` (hosts none).

    Args:
        address: ``host:port`` of the running coordination service.
        process_id: this process's id, in ``[0, num_processes)``.
        num_processes: the number of processes the service expects.
        init_timeout: seconds to wait for every process to connect.
        heartbeat_timeout: seconds without heartbeats after which a process counts as dead.
        local_device_ids: the GPUs this process uses (None: all visible).
        shutdown_timeout: seconds the shutdown waits for the others.
    """
    from jax._src import config, distributed
    from jax._src.lib import _jax

    state = distributed.global_state
    if state.client is not None:
        raise RuntimeError("jax.distributed is already initialized.")
    if local_device_ids:
        visible = ",".join(str(x) for x in local_device_ids)
        config.update("jax_cuda_visible_devices", visible)
        config.update("jax_rocm_visible_devices", visible)
    client = _jax.get_distributed_runtime_client(
        address,
        process_id,
        init_timeout=init_timeout,
        heartbeat_timeout=heartbeat_timeout,
        shutdown_timeout=shutdown_timeout,
        use_compression=True,
    )
    client.connect()
    state.coordinator_address = address
    state.process_id = process_id
    state.num_processes = num_processes
    state.client = client
    state.initialize_preemption_sync_manager()
