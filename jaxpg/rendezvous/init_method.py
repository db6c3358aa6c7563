"""Rendezvous: how the processes of a job find each other, as torch's ``init_method``.

:func:`rendezvous` turns ``init_method`` (or a ``store``) plus ``rank`` and
``world_size`` into a :class:`RendezvousInfo`: the coordinator address of JAX's
coordination service and this process's place in the job. The forms are torch's:

* ``"env://"`` (the default) reads ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``, as ``jaxpg-run`` sets them;
  without ``RANK``, the world a cluster launcher made: a Slurm step started by ``srun``,
  Open MPI's or MPICH's ``mpirun`` (:mod:`jaxpg.rendezvous.cluster_env`).
* ``"tcp://host:port"`` names the coordinator; ``rank`` and ``world_size`` come
  from the arguments (or ``?rank=..&world_size=..`` in the URL), else from the launcher.
* ``"file:///path"`` meets through a :class:`~jaxpg.stores.FileStore`: each process
  claims its rank in the file, process 0 picks a free port and publishes the
  coordinator address there, and the others read it. The file must be fresh.
* ``store=...`` does the same through any store (a ``TCPStore`` already knows the
  coordinator).

:func:`initialize_jax_distributed` then starts ``jax.distributed`` from the info
and returns the world's store. Example, in a script started by ``jaxpg-run``::

    info = rendezvous("env://")
    store = initialize_jax_distributed(info, timeout=60)
    store.add("arrived", 1)
"""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from urllib.parse import parse_qs, urlparse

from jaxpg.errors import DistError, DistStoreError, DistTimeoutError
from jaxpg.rendezvous.cluster_env import LauncherWorld, detect_launcher
from jaxpg.runtime.coordination_service import start_jax_distributed
from jaxpg.stores import DEFAULT_TIMEOUT, FileStore, HashStore, PrefixStore, Store, TCPStore
from jaxpg.stores.store import Timeout, to_seconds

__all__ = [
    "RendezvousInfo",
    "free_port",
    "initialize_jax_distributed",
    "rendezvous",
    "shutdown_jax_distributed",
]

_ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
_RDZV = "jaxpg/rendezvous/"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RendezvousInfo:
    """Where the coordinator is and where this process stands in the job.

    Attributes:
        coordinator_address: ``"host:port"`` of JAX's coordination service, or
            ``None`` for a one-process world, which needs none.
        rank: this process's index, in ``[0, world_size)``.
        world_size: the number of processes.
        local_rank: this process's index on its machine.
        local_world_size: the number of processes on this machine.
        store: the store the rendezvous went through (``file://`` or ``store=``),
            or ``None`` when the coordination service's store is to be used.
        init_method: the ``init_method`` it came from, for messages.
        launcher: the cluster launcher whose variables gave the world (``"slurm"``,
            ``"openmpi"``, ``"mpich"``), or ``None``.
    """

    coordinator_address: str | None
    rank: int
    world_size: int
    local_rank: int = 0
    local_world_size: int = 1
    store: Store | None = None
    init_method: str | None = None
    launcher: str | None = None

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "local_rank", "local_world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name}={value!r} must be an int.")
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} must be at least 1.")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank={self.rank} must be in [0, world_size={self.world_size}); ranks count "
                "from 0."
            )
        if self.local_world_size < 1 or not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"local_rank={self.local_rank} must be in [0, local_world_size="
                f"{self.local_world_size})."
            )
        if self.world_size > 1 and not self.coordinator_address:
            raise ValueError(
                f"coordinator_address={self.coordinator_address!r}: a world of "
                f"{self.world_size} processes needs a 'host:port' for the coordinator."
            )


def free_port(host: str = "127.0.0.1") -> int:
    """Returns a TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _int_or_none(value: int | None, name: str) -> int | None:
    if value is None or value == -1:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be an int.")
    return value


def _env_int(name: str, default: int | None = None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"The environment variable {name}={raw!r} must be an integer.") from None


def _query_int(query: dict[str, list[str]], name: str, init_method: str) -> int | None:
    if name not in query:
        return None
    try:
        return int(query[name][-1])
    except ValueError:
        raise ValueError(f"init_method={init_method!r}: {name} must be an integer.") from None


def _locals(rank: int, world_size: int) -> tuple[int, int]:
    """LOCAL_RANK and LOCAL_WORLD_SIZE from the environment, else one machine."""
    return _env_int("LOCAL_RANK", rank), _env_int("LOCAL_WORLD_SIZE", world_size)


def _cluster_world() -> LauncherWorld | None:
    """The world a cluster launcher (Slurm, mpirun) made, when ``RANK`` is not set."""
    if os.environ.get("RANK", "").strip():
        return None  # torchrun's variables win; _from_env reads them
    found = detect_launcher()
    return None if found is None or found.launcher == "torchrun" else found


def _from_launcher(found: LauncherWorld, rank: int | None, world_size: int | None,
                   init_method: str) -> RendezvousInfo:
    """Explicit arguments first, then the cluster launcher's variables."""
    rank = found.rank if rank is None else rank
    world_size = found.world_size if world_size is None else world_size
    if world_size > 1 and found.coordinator is None:
        raise ValueError(
            f"init_method={init_method!r}: {found.launcher} started {world_size} processes "
            f"({found.variables}) on several machines, and its variables do not say where "
            "rank 0 runs. Set MASTER_ADDR to rank 0's host (and MASTER_PORT to a free port) "
            "in every process, e.g. mpirun -x MASTER_ADDR=<host> -x MASTER_PORT=29500."
        )
    local_world_size = max(found.local_world_size, found.local_rank + 1)
    return RendezvousInfo(
        coordinator_address=found.coordinator if world_size > 1 else None,
        rank=rank,
        world_size=world_size,
        local_rank=found.local_rank,
        local_world_size=local_world_size,
        init_method=init_method,
        launcher=found.launcher,
    )


def _from_env(rank: int | None, world_size: int | None) -> RendezvousInfo:
    found = _cluster_world()
    if found is not None:
        return _from_launcher(found, rank, world_size, "env://")
    rank = _env_int("RANK") if rank is None else rank
    world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
    needed = ["RANK"] * (rank is None) + ["WORLD_SIZE"] * (world_size is None)
    if world_size != 1:
        needed += [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if needed:
        raise ValueError(
            "init_method='env://' needs the environment variables "
            f"{', '.join(_ENV_VARS)}; missing: {', '.join(needed)}. Start the script with "
            "jaxpg-run (which sets them), srun or mpirun (whose worlds jaxpg reads), set them "
            "yourself, or pass rank= and world_size=."
        )
    assert rank is not None and world_size is not None
    address = None
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        _env_int("MASTER_PORT")
        address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    local_rank, local_world_size = _locals(rank, world_size)
    return RendezvousInfo(
        coordinator_address=address,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        init_method="env://",
    )


def _base(store: Store) -> Store:
    return store.underlying_store if isinstance(store, PrefixStore) else store


def _through_store(
    store: Store, rank: int, world_size: int, init_method: str | None
) -> RendezvousInfo:
    """Claims ``rank`` in ``store``; rank 0 publishes a coordinator address."""
    local_rank, local_world_size = _locals(rank, world_size)
    base = _base(store)
    if isinstance(base, TCPStore):
        address = f"{base.host}:{base.port}"
    elif world_size == 1:
        address = None
    else:
        token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
        owner = store.compare_set(f"{_RDZV}rank/{rank}", b"", token)
        if owner != token.encode():
            raise DistError(
                f"rank={rank} was already claimed in the rendezvous store by {owner.decode()!r}: "
                "either two processes were given the same rank, or the store (file) still "
                "holds a previous run's rendezvous. Use a fresh store or file for each run."
            )
        if rank == 0:
            host = os.environ.get("MASTER_ADDR") or "127.0.0.1"
            address = f"{host}:{free_port(host)}"
            store.set(f"{_RDZV}coordinator", address)
        else:
            address = _coordinator_from_store(store, rank, world_size)
    return RendezvousInfo(
        coordinator_address=address,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        store=store,
        init_method=init_method,
    )


def _claimed_ranks(store: Store, world_size: int) -> list[int]:
    """The ranks claimed in ``store``'s rendezvous so far (each process claims its own)."""
    return [r for r in range(world_size) if store.check([f"{_RDZV}rank/{r}"])]


def _coordinator_from_store(store: Store, rank: int, world_size: int) -> str:
    """The coordinator address rank 0 publishes in ``store``; a named DistTimeoutError if
    it does not come within the store's timeout."""
    key = f"{_RDZV}coordinator"
    try:
        store.wait([key])
    except DistStoreError:
        seconds = store.timeout.total_seconds()
        claimed = _claimed_ranks(store, world_size)
        raise DistTimeoutError(
            f"init_process_group: rank 0 did not publish the coordinator's address in the "
            f"rendezvous store within {seconds:.1f} s (this is rank {rank} of {world_size}); "
            f"{len(claimed)} of {world_size} processes joined; ranks that never joined: "
            f"{[r for r in range(world_size) if r not in claimed]}."
        ) from None
    return store.get(key).decode()


def rendezvous(
    init_method: str | None = None,
    *,
    rank: int = -1,
    world_size: int = -1,
    store: Store | None = None,
    timeout: Timeout = DEFAULT_TIMEOUT,
) -> RendezvousInfo:
    """Finds the coordinator and this process's rank, as torch's ``init_method`` does.

    Args:
        init_method: ``"env://"`` (default), ``"tcp://host:port"`` or
            ``"file:///path"``. Mutually exclusive with ``store``.
        rank: this process's rank; -1 to take it from the environment or URL.
        world_size: the number of processes; -1 likewise.
        store: a store to meet through instead of ``init_method``.
        timeout: how long to wait for the other processes.

    Returns:
        The :class:`RendezvousInfo` to pass to :func:`initialize_jax_distributed`.

    Raises:
        ValueError: for a bad ``init_method``, both ``init_method`` and ``store``,
            missing ``rank``/``world_size`` or environment variables.
        DistError: if the rank is already taken in the rendezvous store.
    """
    rank_ = _int_or_none(rank, "rank")
    world_size_ = _int_or_none(world_size, "world_size")
    seconds = to_seconds(timeout)
    if store is not None:
        if init_method is not None:
            raise ValueError(
                f"Cannot specify both init_method={init_method!r} and store={store!r}; "
                "pass one of them."
            )
        if not isinstance(store, Store):
            raise TypeError(f"store={store!r} must be a jaxpg Store.")
        if rank_ is None or world_size_ is None:
            raise ValueError(
                f"With store=..., pass rank and world_size too (got rank={rank}, "
                f"world_size={world_size})."
            )
        return _through_store(store, rank_, world_size_, None)
    init_method = "env://" if init_method is None else init_method
    if not isinstance(init_method, str):
        raise TypeError(f"init_method={init_method!r} must be a str such as 'env://'.")
    url = urlparse(init_method)
    query = parse_qs(url.query)
    if url.scheme == "env":
        return _from_env(rank_, world_size_)
    rank_ = rank_ if rank_ is not None else _query_int(query, "rank", init_method)
    world_size_ = (
        world_size_ if world_size_ is not None else _query_int(query, "world_size", init_method)
    )
    if url.scheme in ("tcp", "file") and (rank_ is None or world_size_ is None):
        found = detect_launcher()  # explicit arguments first, then the launcher's world
        if found is not None:
            rank_ = found.rank if rank_ is None else rank_
            world_size_ = found.world_size if world_size_ is None else world_size_
    if url.scheme in ("tcp", "file") and (rank_ is None or world_size_ is None):
        raise ValueError(
            f"init_method={init_method!r} needs rank and world_size: pass rank=... and "
            f"world_size=... (got rank={rank}, world_size={world_size})."
        )
    assert rank_ is not None and world_size_ is not None
    if url.scheme == "tcp":
        if not url.hostname or url.port is None:
            raise ValueError(
                f"init_method={init_method!r} must look like 'tcp://host:port', "
                "e.g. 'tcp://127.0.0.1:29500'."
            )
        local_rank, local_world_size = _locals(rank_, world_size_)
        return RendezvousInfo(
            coordinator_address=f"{url.hostname}:{url.port}",
            rank=rank_,
            world_size=world_size_,
            local_rank=local_rank,
            local_world_size=local_world_size,
            init_method=init_method,
        )
    if url.scheme == "file":
        if not url.path:
            raise ValueError(f"init_method={init_method!r} must look like 'file:///path/to/file'.")
        file_store = FileStore(url.path, world_size_, timeout=seconds)
        return _through_store(file_store, rank_, world_size_, init_method)
    raise ValueError(
        f"init_method={init_method!r} is not supported; use 'env://', 'tcp://host:port' "
        "or 'file:///path'."
    )


def initialize_jax_distributed(
    info: RendezvousInfo,
    timeout: Timeout = DEFAULT_TIMEOUT,
    *,
    heartbeat_timeout: Timeout = 100,
    local_device_ids: list[int] | None = None,
) -> Store:
    """Starts ``jax.distributed`` as ``info`` says and returns the world's store.

    A one-process world starts nothing. If ``jax.distributed`` is already running,
    its process id and count must match ``info``. On CPU, cross-process
    collectives use gloo (``jax_cpu_collectives_implementation``), listening on an
    address the other hosts can reach (:mod:`jaxpg.runtime.gloo_interface`). Under ``jaxpg-run``
    the launcher hosts the coordination service and every process, rank 0 included,
    joins it as a client (:mod:`jaxpg.runtime.hosted_coordinator`). Call this before
    anything that initializes JAX's backends (``jax.devices()``, any computation).

    Args:
        info: the result of :func:`rendezvous`.
        timeout: how long to wait for every process to connect; also the store's.
        heartbeat_timeout: after how long without heartbeats a process counts as dead.
        local_device_ids: the devices this process uses; ``None`` for all visible
            (``jaxpg-run`` already makes each worker see only its own).

    Returns:
        ``info.store`` if the rendezvous had one; else a :class:`TCPStore` on the
        coordination service, or a :class:`HashStore` in a one-process world.

    If a peer never connects, or the coordinator cannot be reached, it raises
    ``DistTimeoutError`` within ``timeout`` (plus the few seconds JAX's client adds), naming
    the ranks that never joined or the address (:mod:`jaxpg.runtime.service_client`).

    Raises:
        DistTimeoutError: not every process joined within ``timeout``.
        DistBackendError: if JAX's backends already started, or
            ``jax.distributed.initialize`` raised.
        ValueError: if a running ``jax.distributed`` disagrees with ``info``, or
            ``GLOO_SOCKET_IFNAME`` names an interface this machine does not have.
    """
    from jaxpg._jax_compat import distributed_state

    seconds = to_seconds(timeout)
    if distributed_state().client is None and info.world_size == 1:
        return info.store if info.store is not None else HashStore(timeout=seconds)
    address = info.coordinator_address
    assert address is not None or distributed_state().client is not None
    lobby = None
    if info.store is not None and not isinstance(_base(info.store), TCPStore):
        lobby = lambda: _claimed_ranks(info.store, info.world_size)  # noqa: E731
    client = start_jax_distributed(
        address or "", info.world_size, info.rank, timeout=seconds,
        heartbeat_timeout=to_seconds(heartbeat_timeout), local_device_ids=local_device_ids,
        lobby=lobby)
    if info.store is not None:
        return info.store
    return TCPStore._from_client(client, timeout=seconds)


def shutdown_jax_distributed() -> None:
    """Stops ``jax.distributed`` if it runs (waits for the other processes).

    Rank 0, when it hosts the service in a child process, first waits until the other
    processes left it (at most 300 s), then stops the child
    (:mod:`jaxpg.runtime.coordinator_process`).
    """
    import jax

    if jax.distributed.is_initialized():
        from jaxpg.runtime import hosted_coordinator

        hosted_coordinator.clear_before_shutdown()
        from jaxpg._jax_compat import distributed_state
        from jaxpg.runtime import coordination_service, coordinator_process

        state = distributed_state()
        address = state.coordinator_address
        if coordinator_process.running() is not None:  # rank 0, hosting the service child
            coordinator_process.finish(state.client, state.num_processes, 300.0,
                                       jax.distributed.shutdown)
        jax.distributed.shutdown()
        if coordination_service.service_host == "rank0-child" and address:
            # a new world made at once must not join this one's service before it stops
            coordinator_process.wait_until_stopped(address, 30.0)
        coordination_service.service_host = None
