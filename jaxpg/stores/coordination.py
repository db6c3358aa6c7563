"""JAX's coordination service, where ``TCPStore`` keeps its keys: reach its client, or start it.

``jax.distributed.initialize`` starts the service on process 0 and connects every process to
it; the client it leaves in ``jax._src.distributed.global_state`` is all a ``TCPStore``
needs. torch's ``TCPStore(host, port, world_size, is_master)`` starts the service itself
when none runs: it does so here, in the stores layer, so that the store does not import
the rendezvous (which sits above the stores and decides where the coordinator is).
"""

from __future__ import annotations

import math
import os
from typing import Any

from jaxpg.errors import DistBackendError

__all__ = ["global_client", "start_jax_distributed"]


def global_client() -> Any | None:
    """The running coordination-service client, or None before ``jax.distributed`` starts."""
    from jax._src import distributed

    return distributed.global_state.client


def start_jax_distributed(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    *,
    timeout: float,
    heartbeat_timeout: float = 100,
    local_device_ids: list[int] | None = None,
) -> Any:
    """Starts ``jax.distributed`` (or checks the running one) and returns its client.

    On CPU, cross-process collectives use gloo (``jax_cpu_collectives_implementation``)
    unless something chose otherwise first, listening on an address the other hosts can
    reach (:mod:`jaxpg.gloo_device`). Under ``jaxpg-run`` the launcher hosts the
    coordination service and every process, rank 0 included, joins it as a client
    (:mod:`jaxpg.hosted_coordinator`). Call this before anything that initializes
    JAX's backends (``jax.devices()``, any computation).

    Args:
        coordinator_address: ``"host:port"`` of process 0's coordination service.
        num_processes: the number of processes.
        process_id: this process's index, in ``[0, num_processes)``.
        timeout: seconds to wait for every process to connect.
        heartbeat_timeout: seconds without heartbeats after which a process counts as dead.
        local_device_ids: the devices this process uses; None for all visible.

    Raises:
        ValueError: if the arguments are out of range, a running ``jax.distributed``
            disagrees with them, or ``GLOO_SOCKET_IFNAME`` names an interface this machine
            does not have.
        DistBackendError: if JAX's backends already started, or
            ``jax.distributed.initialize`` raised.
    """
    import jax
    from jax._src import config as jax_config
    from jax._src import distributed, xla_bridge

    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(
            f"process_id={process_id} must be in [0, num_processes={num_processes}) and "
            "num_processes at least 1."
        )
    state = distributed.global_state
    if state.client is not None:
        if (state.process_id, state.num_processes) != (process_id, num_processes):
            raise ValueError(
                f"jax.distributed is already running as process {state.process_id} of "
                f"{state.num_processes}, but rank={process_id}, world_size={num_processes} "
                "were asked for; pass matching values."
            )
        return state.client
    if xla_bridge.backends_are_initialized():
        raise DistBackendError(
            "JAX's backends are already initialized, so jax.distributed cannot start; call "
            "init_process_group before jax.devices() or any JAX computation."
        )
    if jax_config.cpu_collectives_implementation.value is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", coordinator_address)
    if jax_config.cpu_collectives_implementation.value == "gloo":
        from jaxpg import gloo_device  # where gloo listens: reachable from other hosts

        host = coordinator_address.rpartition(":")[0].strip("[]")
        gloo_device.install(gloo_device.choose_gloo_device(host))
    init_timeout = max(1, math.ceil(timeout))
    heartbeat = max(1, math.ceil(heartbeat_timeout))
    try:
        from jaxpg import hosted_coordinator  # jaxpg-run's launcher hosts the service

        if hosted_coordinator.hosted_address() == coordinator_address:
            hosted_coordinator.connect(
                coordinator_address,
                process_id,
                num_processes,
                init_timeout=init_timeout,
                heartbeat_timeout=heartbeat,
                local_device_ids=local_device_ids,
            )
        else:
            jax.distributed.initialize(
                coordinator_address=coordinator_address,
                num_processes=num_processes,
                process_id=process_id,
                local_device_ids=local_device_ids,
                cluster_detection_method="deactivate",
                initialization_timeout=init_timeout,
                heartbeat_timeout_seconds=heartbeat,
                coordinator_bind_address=bind,
            )
    except Exception as err:
        raise DistBackendError(
            f"jax.distributed.initialize(coordinator_address={coordinator_address!r}, "
            f"num_processes={num_processes}, process_id={process_id}) failed: {err}. "
            f"Check that all {num_processes} processes started and can reach "
            f"{coordinator_address}."
        ) from err
    return state.client
