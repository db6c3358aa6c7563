"""JAX's coordination service, where ``TCPStore`` keeps its keys: reach its client, or start it.

``jax.distributed.initialize`` starts the service on process 0 and connects every process to
it; the client it leaves in jax's distributed state is all a ``TCPStore`` needs. torch's
``TCPStore(host, port, world_size, is_master)`` starts the service itself when none runs: it
does so here, in the stores layer, so that the store does not import the rendezvous (which
sits above the stores and decides where the coordinator is).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from jaxpg import _jax_compat
from jaxpg.errors import DistBackendError, DistError

__all__ = ["global_client", "start_jax_distributed", "service_host"]

service_host: str | None = None
"""Where the running world's coordination service lives: "launcher" (``jaxpg-run``),
"rank0-child" (a child process of rank 0, :mod:`jaxpg.runtime.coordinator_process`), "rank0" (in
rank 0's own process), or None before ``jax.distributed`` starts through jaxpg."""


def global_client() -> Any | None:
    """The running coordination-service client, or None before ``jax.distributed`` starts."""
    return _jax_compat.distributed_state().client


def start_jax_distributed(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    *,
    timeout: float,
    heartbeat_timeout: float = 100,
    local_device_ids: list[int] | None = None,
    lobby: Callable[[], Iterable[int] | None] | None = None,
) -> Any:
    """Starts ``jax.distributed`` (or checks the running one) and returns its client.

    On CPU, cross-process collectives use gloo (``jax_cpu_collectives_implementation``)
    unless something chose otherwise first, listening on an address the other hosts can
    reach (:mod:`jaxpg.runtime.gloo_interface`). Under ``jaxpg-run`` the launcher hosts the
    coordination service and every process, rank 0 included, joins it as a client
    (:mod:`jaxpg.runtime.hosted_coordinator`). Call this before anything that initializes
    JAX's backends (``jax.devices()``, any computation).

    Args:
        coordinator_address: ``"host:port"`` of process 0's coordination service.
        num_processes: the number of processes.
        process_id: this process's index, in ``[0, num_processes)``.
        timeout: seconds to wait for every process to connect.
        heartbeat_timeout: seconds without heartbeats after which a process counts as dead.
        local_device_ids: the devices this process uses; None for all visible.
        lobby: returns the ranks known to have reached the rendezvous (the rendezvous
            store's claims), to name the missing ones if the connect times out.

    Raises:
        DistTimeoutError: the coordinator could not be reached, or not every process
            joined, within ``timeout``; the message names the address or the missing
            ranks (:mod:`jaxpg.runtime.service_client`). Never JAX's C++ abort.
        ValueError: if the arguments are out of range, a running ``jax.distributed``
            disagrees with them, or ``GLOO_SOCKET_IFNAME`` names an interface this machine
            does not have.
        DistBackendError: if JAX's backends already started, or
            ``jax.distributed.initialize`` raised.
    """
    import jax

    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(
            f"process_id={process_id} must be in [0, num_processes={num_processes}) and "
            "num_processes at least 1."
        )
    state = _jax_compat.distributed_state()
    if state.client is not None:
        if (state.process_id, state.num_processes) != (process_id, num_processes):
            raise ValueError(
                f"jax.distributed is already running as process {state.process_id} of "
                f"{state.num_processes}, but rank={process_id}, world_size={num_processes} "
                "were asked for; pass matching values."
            )
        return state.client
    if _jax_compat.backends_are_initialized():
        raise DistBackendError(
            "JAX's backends are already initialized, so jax.distributed cannot start; call "
            "init_process_group before jax.devices() or any JAX computation."
        )
    if _jax_compat.cpu_collectives_implementation() is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", coordinator_address)
    if _jax_compat.cpu_collectives_implementation() == "gloo":
        from jaxpg.runtime import gloo_interface  # where gloo listens: reachable from other hosts

        host = coordinator_address.rpartition(":")[0].strip("[]")
        gloo_interface.install(gloo_interface.choose_gloo_device(host))
    heartbeat = max(1, math.ceil(heartbeat_timeout))
    from jaxpg.runtime import (
        coordinator_process,  # rank 0's service, in a child process
        hosted_coordinator,  # jaxpg-run's launcher hosts the service
        service_client,  # joining it within the timeout, with named errors
    )

    deadline = time.monotonic() + timeout
    service_client.note_arrival(process_id)
    try:
        launcher_hosted = hosted_coordinator.hosted_address() == coordinator_address
        child_hosted = not launcher_hosted and coordinator_process.enabled()
        if child_hosted and process_id == 0:
            coordinator_process.start(bind, num_processes, heartbeat,
                                      register_by=time.time() + deadline - time.monotonic())
        elif not launcher_hosted and process_id == 0:  # JAXPG_COORDINATOR_PROCESS=0
            service_client.check_port_free(bind)
            state.service = _jax_compat.distributed_runtime_service(
                bind, num_processes, heartbeat_timeout=heartbeat,
                cluster_register_timeout=max(1, int(deadline - time.monotonic())),
                shutdown_timeout=300)
        if lobby is None:  # jaxpg-run's lobby folder, if the launcher made one
            lobby = service_client.lobby_arrivals
        hosted_coordinator.connect(
            coordinator_address,
            process_id,
            num_processes,
            init_timeout=timeout,
            heartbeat_timeout=heartbeat,
            local_device_ids=local_device_ids,
            host="jaxpg-run" if launcher_hosted else "rank 0",
            lobby=lobby,
            deadline=deadline,
        )
    except Exception as err:
        if coordinator_process.running() is not None:  # started here: stop it again
            coordinator_process.finish(state.client or _NoClient(), num_processes, 0,
                                       state.shutdown)
        if state.service is not None and state.client is None:
            state.service.shutdown()
            state.service = None
        if isinstance(err, DistError):
            raise
        raise DistBackendError(
            f"jax.distributed.initialize(coordinator_address={coordinator_address!r}, "
            f"num_processes={num_processes}, process_id={process_id}) failed: {err}. "
            f"Check that all {num_processes} processes started and can reach "
            f"{coordinator_address}."
        ) from err
    global service_host
    service_host = ("launcher" if launcher_hosted else "rank0-child" if child_hosted
                    else "rank0")
    return state.client


class _NoClient:
    """Stands in for a client that never connected (``coordinator_process.finish``)."""

    def get_live_nodes(self, nodes: list[int]) -> list[int]:
        return []

    def shutdown(self) -> None:
        pass
