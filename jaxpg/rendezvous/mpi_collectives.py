"""XLA's MPI collectives for ``backend="mpi"``: start them, keep to their thread, end them last.

torch's ``ProcessGroupMPI`` needs no rendezvous: ``mpirun`` starts the processes and MPI
says who is who. jaxpg reads the same world from ``mpirun``'s variables
(:mod:`jaxpg.rendezvous.cluster_env`), still starts JAX's coordination service (XLA's CPU
client exchanges its topology through it, and jaxpg's store and progress records live
there), and moves every tensor byte with XLA's MPI collectives, which jaxlib reaches
through MPItrampoline and the ``libmpiwrapper.so`` named by ``MPITRAMPOLINE_LIB``
(:mod:`jaxpg.runtime.mpi_library`).

Three rules of XLA's MPI collectives (jaxlib 0.10.2 and 0.12.0.1, Open MPI 4.1) shape this:

* **One thread.** MPI starts with ``MPI_THREAD_FUNNELED``, and XLA refuses to create a
  communicator on any thread but the one that started MPI ("MPI: Communicator requested
  from a thread that is not the one MPI was initialized from"). With JAX's asynchronous CPU
  dispatch, computations run on XLA's worker threads, so :func:`prepare` turns it off
  (``jax_cpu_enable_async_dispatch=False``): every computation of the process then runs on
  the thread that dispatches it, and jaxpg dispatches eager collectives on the caller's
  thread (no runner thread). MPI starts on the thread that calls ``init_process_group``.
  One device per process (XLA runs several local devices on several threads).
* **Communicators are made with ``MPI_Comm_split`` over ``MPI_COMM_WORLD``**, which every
  process must enter, once per new set of devices; see ``jaxpg.groups.backend``.
* **Finalizing**: jax registers ``MPI_Finalize`` as a Python ``atexit`` handler, but XLA's
  communicators are freed later (with the CPU client, during the interpreter's teardown),
  and Open MPI aborts the job: "The MPI_Comm_free() function was called after
  MPI_FINALIZE was invoked". jaxpg starts MPI itself and registers ``MPI_Finalize`` with
  the C library's ``__cxa_atexit`` when MPI starts, before any communicator exists: it then
  runs after the interpreter's teardown and after the C++ destructors of everything made
  later, which is the order MPI requires.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from jaxpg import _jax_compat
from jaxpg.errors import DistBackendError
from jaxpg.runtime import mpi_library

__all__ = ["check_started", "main_thread", "prepare", "started", "warm_up"]

_collectives: Any = None  # the process's MpiCollectives: MPI starts once per process
_library: Any = None  # ctypes handle on libmpiwrapper (already loaded by jaxlib)
_thread: int | None = None  # the thread that started MPI
_mpi_world: tuple[int, int] | None = None  # (rank, size) as MPI_COMM_WORLD has them


def prepare() -> None:
    """Before ``jax.distributed`` starts: checks the library, turns async dispatch off and
    makes JAX's CPU backend, when it starts, use MPI collectives started by this module.

    Raises:
        DistBackendError: ``MPITRAMPOLINE_LIB`` is unset, wrong, or was set after jax was
            imported; or JAX's backends already started.
    """
    import jax

    mpi_library.require_loaded()
    if _jax_compat.backends_are_initialized() and _collectives is None:
        raise DistBackendError(
            "backend='mpi': JAX's backends are already initialized, so the CPU client cannot "
            "use MPI collectives; call init_process_group before jax.devices() or any JAX "
            "computation."
        )
    jax.config.update("jax_cpu_collectives_implementation", "mpi")
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    if _jax_compat.cpu_backend_factory() is not _cpu_client_factory:
        _jax_compat.register_cpu_backend_factory(_cpu_client_factory)


def _cpu_client_factory() -> Any:
    """JAX's CPU client, with MPI collectives when ``jax.distributed`` runs."""
    state = _jax_compat.distributed_state()
    if state.client is None or _jax_compat.cpu_collectives_implementation() != "mpi":
        return _jax_compat.make_cpu_client()
    return _jax_compat.make_cpu_client(collectives=_start())


def _start() -> Any:
    """Starts MPI once (``MPI_Init_thread`` on this thread) and arranges its finalization."""
    global _collectives, _library, _thread, _mpi_world
    if _collectives is not None:
        return _collectives
    collectives = _jax_compat.make_mpi_collectives()
    collectives.Init()
    library = ctypes.CDLL(mpi_library.loaded_path() or mpi_library.require_loaded())
    world = ctypes.c_size_t.in_dll(library, "MPIABI_COMM_WORLD")
    rank, size = ctypes.c_int(-1), ctypes.c_int(-1)
    library.MPIABI_Comm_rank(world, ctypes.byref(rank))
    library.MPIABI_Comm_size(world, ctypes.byref(size))
    _finalize_at_process_exit(library)
    _collectives, _library, _thread = collectives, library, threading.get_ident()
    _mpi_world = (rank.value, size.value)
    return collectives


def _finalize_at_process_exit(library: Any) -> None:
    """``MPI_Finalize`` at the C library's exit, after everything registered later."""
    libc = ctypes.CDLL(None)
    finalize = ctypes.cast(library.MPIABI_Finalize, ctypes.c_void_p)
    if libc.__cxa_atexit(finalize, None, None) != 0:
        raise DistBackendError("backend='mpi': could not register MPI_Finalize at exit.")


def started() -> bool:
    """Whether this process started MPI (through ``init_process_group(backend="mpi")``)."""
    return _collectives is not None


def main_thread() -> int | None:
    """The ``threading.get_ident()`` of the thread that started MPI, or None."""
    return _thread


def check_started(process_index: int, process_count: int, local_devices: int) -> None:
    """After JAX's CPU client started: MPI runs, with the jaxpg world's processes, one
    device each.

    Raises:
        DistBackendError: MPI did not start (another CPU client factory won), MPI's world
            is not the launcher's (the processes were not started by one ``mpirun``, or
            the library belongs to another MPI), or a process has several devices.
    """
    if _mpi_world is None:
        raise DistBackendError(
            "backend='mpi': JAX's CPU client started without jaxpg's MPI collectives; call "
            "init_process_group(backend='mpi') before any other JAX work."
        )
    rank, size = _mpi_world
    if size != process_count:
        raise DistBackendError(
            f"backend='mpi': MPI sees this process as rank {rank} of {size}, but the world "
            f"has {process_count} processes (this one is {process_index}). Start every "
            "process with one mpirun (or srun --mpi=pmix), one process per rank; processes "
            "started by jaxpg-run or by hand cannot share MPI. Check also that "
            f"{mpi_library.ENV_VAR} was built against that mpirun's MPI."
        )
    if local_devices != 1:
        raise DistBackendError(
            f"backend='mpi' runs one device per process (XLA's MPI collectives serve one "
            f"thread), but this process has {local_devices}; start one process per device "
            "(unset --xla_force_host_platform_device_count, or use backend='gloo')."
        )


def warm_up(devices: list[Any]) -> None:
    """Sums every process's index over the world's devices, on this (MPI's) thread.

    This makes the world's communicator (every process enters its ``MPI_Comm_split`` now,
    together) and proves the MPI collectives work before the program relies on them.

    Raises:
        DistBackendError: the sum is wrong.
    """
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(devices, dtype=object), ("world",))
    spec = P("world")
    total = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "world"), mesh=mesh,
                                  in_specs=spec, out_specs=spec))
    me = jax.process_index()
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, spec),
                                               np.array([me + 1], np.int32), (len(devices),))
    got = int(np.asarray(total(x).addressable_shards[0].data)[0])
    want = len(devices) * (len(devices) + 1) // 2
    if got != want:
        raise DistBackendError(
            f"backend='mpi': a test all-reduce over the {len(devices)} processes gave {got}, "
            f"not {want}: MPI's world is not the launcher's. Check that {mpi_library.ENV_VAR} "
            "was built against the MPI of the mpirun that started the job."
        )
