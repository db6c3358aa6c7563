"""Joining a coordination service that someone else hosts (``jaxpg-run``'s launcher).

``jax.distributed.initialize`` makes process 0 host JAX's coordination service, so when
process 0 dies the service dies with it and JAX's agents in every other process end them
with a C++ fatal error. ``jaxpg-run`` hosts the service in the launcher instead and tells the
workers through ``JAXPG_COORDINATOR_HOSTED=<host:port>``; :func:`connect` then starts
``jax.distributed`` in every process, process 0 included, as a client only. Afterwards
``jax.distributed`` is in the same state as after ``initialize`` (``jax.process_index()``,
the CPU client's gloo collectives, ``jax.distributed.shutdown()`` all work as usual).

Every jaxpg world joins this way, whoever hosts the service (the launcher, rank 0's child
process, or rank 0's own process with ``JAXPG_COORDINATOR_PROCESS=0``): the client is
connected by :mod:`jaxpg.runtime.service_client`, so a process that never comes is a named
``DistTimeoutError`` within the timeout instead of JAX's C++ abort.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

__all__ = ["connect", "hosted_address", "preemption_sync_asked"]

ENV_VAR = "JAXPG_COORDINATOR_HOSTED"
PREEMPTION_VAR = "JAX_ENABLE_PREEMPTION_SERVICE"


def preemption_sync_asked() -> bool:
    """Whether this process asked for JAX's preemption sync manager.

    The manager's notifier catches SIGTERM in C++ and only records it for
    ``multihost_utils.reached_preemption_sync_point`` (orbax's save on preemption): a
    program that never asks goes on running, so a launcher's or a scheduler's stop waits
    out its grace period. It is started only where ``JAX_ENABLE_PREEMPTION_SERVICE`` is in
    the environment and JAX's ``jax_enable_preemption_service`` is on (the variable's
    value, or a later ``jax.config.update``); JAX's own default (on) does not count.
    Without it, SIGTERM ends the process (orbax then sees no preemption).
    """
    if PREEMPTION_VAR not in os.environ:
        return False
    import jax

    return bool(jax.config.jax_enable_preemption_service)


def hosted_address() -> str | None:
    """The address of a launcher-hosted coordination service, if the launcher set one."""
    return os.environ.get(ENV_VAR) or None


def connect(
    address: str,
    process_id: int,
    num_processes: int,
    *,
    init_timeout: float,
    heartbeat_timeout: int,
    local_device_ids: Sequence[int] | None = None,
    shutdown_timeout: int = 300,
    host: str = "jaxpg-run",
    lobby: Callable[[], Iterable[int] | None] | None = None,
    deadline: float | None = None,
) -> None:
    """Starts ``jax.distributed`` as a client of the service at ``address`` (hosts none).

    Args:
        address: ``host:port`` of the running coordination service.
        process_id: this process's id, in ``[0, num_processes)``.
        num_processes: the number of processes the service expects.
        init_timeout: seconds to wait for the service and for every process to connect.
        heartbeat_timeout: seconds without heartbeats after which a process counts as dead.
        local_device_ids: the GPUs this process uses (None: all visible).
        shutdown_timeout: seconds the shutdown waits for the others.
        host: who hosts the service, for messages.
        lobby: the ranks known to have arrived, for a timeout's message
            (:func:`jaxpg.runtime.service_client.connect`).
        deadline: when ``init_timeout`` ends (``time.monotonic()``), if it began earlier.

    Raises:
        DistTimeoutError: the service or a process did not come within ``init_timeout``
            (:mod:`jaxpg.runtime.service_client`); never JAX's C++ abort.
    """
    import jax

    from jaxpg import _jax_compat
    from jaxpg.runtime import service_client

    state = _jax_compat.distributed_state()
    if state.client is not None:
        raise RuntimeError("jax.distributed is already initialized.")
    if local_device_ids:
        visible = ",".join(str(x) for x in local_device_ids)
        jax.config.update("jax_cuda_visible_devices", visible)
        jax.config.update("jax_rocm_visible_devices", visible)
    client = service_client.connect(
        address, process_id, num_processes, timeout=init_timeout,
        heartbeat_timeout=heartbeat_timeout, shutdown_timeout=shutdown_timeout, host=host,
        lobby=lobby, deadline=deadline)
    state.coordinator_address = address
    state.process_id = process_id
    state.num_processes = num_processes
    state.client = client
    if preemption_sync_asked():
        state.initialize_preemption_sync_manager()


_generation = 0
# What a world leaves in the store: XLA's topology exchange and gloo rendezvous (measured on
# CPU; the GPU platforms' names follow the same pattern, not measured: no GPU) and jaxpg's
# TCPStore. The store cannot list its top level, so the names are spelled out.
_WORLD_KEYS = [f"{platform}:{name}" for platform in ("cpu", "cuda", "rocm", "gpu")
               for name in ("gloo", "local_topology", "global_topology")] + [
                   "jaxpg_store", "jaxpg_left", "jaxpg_aborted"]


def clear_before_shutdown(timeout_s: float = 30.0) -> None:
    """Empties the hosted service's key/value store before this world shuts down.

    The launcher's service outlives the world, so a later ``init_process_group`` in the
    same processes would meet the old world's keys (gloo's, the topology's, the store's)
    and fail on "already exists". Every process waits at a barrier, process 0 deletes the
    world's keys, and all wait again. A no-op unless this process joined a hosted service; errors
    (a peer already gone) are ignored: the world is going away anyway.
    """
    global _generation
    from jaxpg import _jax_compat

    state = _jax_compat.distributed_state()
    if state.client is None or state.service is not None:
        return
    if hosted_address() != state.coordinator_address:
        return
    _generation += 1
    client, ms = state.client, int(timeout_s * 1000)
    try:
        client.wait_at_barrier(f"jaxpg/clear/{_generation}/a", ms)
        if state.process_id == 0:
            for key in _WORLD_KEYS:  # a key, or a directory with everything under it
                client.key_value_delete(key)
        client.wait_at_barrier(f"jaxpg/clear/{_generation}/b", ms)
    except Exception:
        pass
