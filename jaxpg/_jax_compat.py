"""Every private jax API jaxpg uses, in one place, each with the jax versions it was checked on.

jax keeps its coordination-service client, its backend registry and its array constructor
behind private modules (``jax._src``, ``jaxlib._jax``). jaxpg needs them to host and join the
coordination service itself, to choose where gloo listens, and to build an eager
collective's global array without a copy. Any jax release may move them, so no other module
imports them: each is reached through one function here. A function whose private API is
missing raises :class:`JaxCompatError`, which names the jax version, the private name and
the jaxpg feature that needs it, instead of an ``AttributeError`` deep inside a collective.

``CHECKED_ON`` lists, per accessor, the jax versions the test suite ran it on
(``tests/test_jax_compat.py`` checks every accessor resolves on the running version).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from jaxpg.errors import DistBackendError

__all__ = [
    "CHECKED_ON",
    "JaxCompatError",
    "array_from_single_block",
    "backends_are_initialized",
    "cpu_backend_factory",
    "cpu_collectives_implementation",
    "distributed_runtime_client",
    "distributed_runtime_service",
    "distributed_state",
    "jit_cache_size",
    "joining_client",
    "make_cpu_client",
    "make_gloo_tcp_collectives",
    "make_mpi_collectives",
    "register_cpu_backend_factory",
]

_TESTED = ("0.10.2", "0.12.0.1")
CHECKED_ON: dict[str, tuple[str, ...]] = {
    "distributed_state": _TESTED,  # jax._src.distributed.global_state
    "backends_are_initialized": _TESTED,  # jax._src.xla_bridge.backends_are_initialized
    "cpu_collectives_implementation": _TESTED,  # jax._src.config.cpu_collectives_implementation
    "distributed_runtime_client": _TESTED,  # jaxlib._jax.get_distributed_runtime_client
    "distributed_runtime_service": _TESTED,  # jaxlib._jax.get_distributed_runtime_service
    "joining_client": _TESTED,  # get_distributed_runtime_client(missed_heartbeat_callback=...)
    "make_gloo_tcp_collectives": _TESTED,  # jaxlib._jax.make_gloo_tcp_collectives
    "make_mpi_collectives": _TESTED,  # jaxlib._jax.make_mpi_collectives
    "make_cpu_client": _TESTED,  # jax._src.xla_bridge.make_cpu_client
    "cpu_backend_factory": _TESTED,  # jax._src.xla_bridge._backend_factories
    "register_cpu_backend_factory": _TESTED,  # jax._src.xla_bridge.register_backend_factory
    "array_from_single_block": _TESTED,  # jax._src.array.ArrayImpl(aval, sharding, arrays)
    "jit_cache_size": _TESTED,  # a jax.jit function's private _cache_size() method
}


class JaxCompatError(DistBackendError):
    """The running jax lacks a private API that a jaxpg feature needs."""


def _jax_version() -> str:
    import jax

    return jax.__version__


def _resolve(module: str, attribute: str, feature: str) -> Any:
    """``module.attribute``, or a :class:`JaxCompatError` naming the version and ``feature``."""
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as err:
        raise JaxCompatError(
            f"jax {_jax_version()} has no {module}.{attribute}, which jaxpg uses for {feature} "
            f"(checked on jax {', '.join(_TESTED)}). Install a jax in that range "
            f"(pip install 'jax>={_TESTED[0]},<=0.12.0.1'), or report the jax version."
        ) from err


def _jaxlib(name: str, feature: str) -> Callable[..., Any]:
    return _resolve("jaxlib._jax", name, feature)


def distributed_state() -> Any:
    """jax's ``global_state`` of ``jax.distributed``: client, service, process id, address."""
    return _resolve("jax._src.distributed", "global_state", "the coordination-service client")


def backends_are_initialized() -> bool:
    """Whether JAX's backends (CPU, GPU, ...) have started."""
    return _resolve("jax._src.xla_bridge", "backends_are_initialized",
                    "checking that jax.distributed can still start")()


def cpu_collectives_implementation() -> str | None:
    """The CPU collectives in use ("gloo", "mpi", "megascale") or None if unset."""
    flag = _resolve("jax._src.config", "cpu_collectives_implementation",
                    "choosing the CPU collectives")
    return flag.value


def distributed_runtime_client(address: str, node_id: int, **kwargs: Any) -> Any:
    """A coordination-service client (not connected); ``kwargs`` as jaxlib's."""
    make = _jaxlib("get_distributed_runtime_client", "joining a coordination service")
    return make(address, node_id, **kwargs)


def _never_called(*args: Any) -> None:
    """The client's error callback; jaxlib cannot call it (see :func:`joining_client`)."""


def joining_client(address: str, node_id: int, **kwargs: Any) -> Any:
    """A coordination-service client whose failed ``connect()`` raises instead of aborting.

    By default JAX's agent reports a failed registration (a peer that never joined, a
    coordinator that never answered) to an error callback that ends the process with a C++
    fatal error (``client.h:80] Terminating process ...``). Given a
    ``missed_heartbeat_callback``, jaxlib converts the ``absl::Status`` for the Python
    callable, cannot, and throws ``std::bad_cast``, which ``connect()`` raises as
    ``RuntimeError('std::bad_cast')`` on the calling thread: a catchable error, after the
    agent logged the status. Checked on jax 0.10.2 and 0.12.0.1 (both raise, after
    ``init_timeout`` + 5 s at most). The same callback firing later, on the agent's
    heartbeat or error-polling thread, ends the process with ``terminate called after
    throwing an instance of 'std::bad_cast'`` instead of JAX's fatal error: an abort
    either way (``jaxpg-run`` explains both).
    """
    return distributed_runtime_client(address, node_id,
                                      missed_heartbeat_callback=_never_called, **kwargs)


def distributed_runtime_service(address: str, num_nodes: int, **kwargs: Any) -> Any:
    """Starts a coordination service listening on ``address``; ``kwargs`` as jaxlib's."""
    make = _jaxlib("get_distributed_runtime_service", "hosting the coordination service")
    return make(address, num_nodes, **kwargs)


def make_gloo_tcp_collectives(**kwargs: Any) -> Any:
    """XLA's gloo CPU collectives over TCP (``distributed_client``, ``hostname``, ...)."""
    return _jaxlib("make_gloo_tcp_collectives", "gloo CPU collectives")(**kwargs)


def make_mpi_collectives() -> Any:
    """XLA's MPI CPU collectives (through MPItrampoline; needs ``MPITRAMPOLINE_LIB``)."""
    return _jaxlib("make_mpi_collectives", "the MPI backend")()


def make_cpu_client(collectives: Any = None) -> Any:
    """JAX's CPU client, with ``collectives`` for cross-process collectives."""
    make = _resolve("jax._src.xla_bridge", "make_cpu_client", "the CPU backend's collectives")
    return make(collectives=collectives)


def cpu_backend_factory() -> Callable[..., Any] | None:
    """The factory registered for JAX's ``cpu`` backend, or None."""
    factories = _resolve("jax._src.xla_bridge", "_backend_factories",
                         "the CPU backend's collectives")
    registration = factories.get("cpu")
    return None if registration is None else registration.factory


def register_cpu_backend_factory(factory: Callable[[], Any]) -> None:
    """Makes JAX's CPU backend, when it starts, come from ``factory``."""
    register = _resolve("jax._src.xla_bridge", "register_backend_factory",
                        "the CPU backend's collectives")
    register("cpu", factory, priority=0, fail_quietly=False)


_array_impl: Any = None


def array_from_single_block(shape: tuple, sharding: Any, block: Any) -> Any:
    """The global array whose one addressable block is ``block``: no copy, no check.

    About 4x cheaper than ``jax.make_array_from_single_device_arrays`` (which it falls back
    to where jax's ``ArrayImpl`` constructor is missing or changed its signature).
    """
    global _array_impl
    import jax

    if _array_impl is None:
        try:
            _array_impl = importlib.import_module("jax._src.array").ArrayImpl
        except (ImportError, AttributeError):
            _array_impl = False
    if _array_impl is not False:
        try:
            return _array_impl(jax.core.ShapedArray(shape, block.dtype), sharding, [block],
                               committed=True, _skip_checks=True)
        except TypeError:  # its signature changed: the public function below
            _array_impl = False
    return jax.make_array_from_single_device_arrays(shape, sharding, [block])


def jit_cache_size(fn: Any) -> int | None:
    """How many programs the jitted ``fn`` compiled so far (its private ``_cache_size()``),
    or None where ``fn`` is not a ``jax.jit`` function or jax dropped the method.

    Checked on jax 0.10.2 and 0.12.0.1 (the C++ ``PjitFunction``'s method). A recorded step
    reads a new program's HLO once, when this grows, instead of keying every call by its
    arguments' shapes (which costs a model's parameters' flattening on every call).
    """
    size = getattr(fn, "_cache_size", None)
    if size is None:
        return None
    try:
        return int(size())
    except Exception:  # noqa: BLE001 (a changed private method: read the HLO per shapes)
        return None
