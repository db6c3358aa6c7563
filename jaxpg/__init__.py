"""jaxpg: torch.distributed's process groups, DDP and pipeline parallelism for JAX.

A rank is a device; a process group is an ordered set of devices (a Mesh). Every
collective runs eagerly from host code or, inside ``jaxpg.spmd``, lowers to ``lax``
collectives under ``shard_map``.
"""

import importlib
import importlib.util

import jaxpg.runtime.mpi_library  # noqa: F401  (first: checks MPITRAMPOLINE_LIB before jax is imported)
from jaxpg.errors import (  # noqa: F401  (the exceptions, loaded eagerly: they import no jax)
    DiscardedResultWarning,
    DistBackendError,
    DistDesyncError,
    DistError,
    DistNetworkError,
    DistStoreError,
    DistTimeoutError,
)

__version__ = "0.1.0"

# ``import jaxpg`` loads no jax: the launcher (``python -m jaxpg.run``, ``jaxpg-run``) is a
# jaxpg module and needs only jaxlib, and it starts once per node and job. The API
# below (collectives, groups, ``spmd``, stores, ``ReduceOp``) is loaded on the first access
# to any of it, and then is plain module attributes. The parallelism packages load flax,
# optax and orbax: ``jaxpg.ddp`` (or ``import jaxpg.ddp``) imports the package on first use.
_API_MODULES = ("jaxpg.collectives", "jaxpg.groups")
_API_NAMES = {"RedOpType": "jaxpg.reduce_op", "ReduceOp": "jaxpg.reduce_op",
              "spmd": "jaxpg.spmd_lowering", "Store": "jaxpg.stores", "HashStore": "jaxpg.stores",
              "FileStore": "jaxpg.stores", "PrefixStore": "jaxpg.stores",
              "TCPStore": "jaxpg.stores"}
# The tiers: every package under jaxpg/ is in exactly one (tests/test_public_tiers.py).
# Public packages are reached by their own names (``jaxpg.supervision.recorded_step``), have
# an API page and are listed by dir(jaxpg). The implementation packages' names reach users
# through the top level (``groups``, ``collectives``) or a public package; ``internal`` holds
# the helpers of jaxpg's tests, benchmarks and tools.
_SUBPACKAGES = ("ddp", "fsdp", "tensor_parallel", "context_parallel", "expert_parallel",
                "pipeline", "models", "train", "plan", "supervision", "stores", "rendezvous",
                "run")
_INTERNAL_PACKAGES = ("collectives", "groups", "data_parallel", "runtime", "internal")
_ERRORS = ["DiscardedResultWarning", "DistBackendError", "DistDesyncError", "DistError",
           "DistNetworkError", "DistStoreError", "DistTimeoutError"]


def _load_api() -> None:
    """Binds the whole API (and ``__all__``) into this module: once, on first use."""
    if "__all__" in globals():
        return
    order = dict.fromkeys([*_API_MODULES, *_API_NAMES.values()])
    modules = {m: importlib.import_module(m) for m in order}
    names = {}
    for module in _API_MODULES:
        names.update(dict.fromkeys(modules[module].__all__, module))
    names.update(_API_NAMES)
    namespace = globals()
    for name, module in names.items():
        namespace[name] = getattr(modules[module], name)
    namespace["__all__"] = [*names, *_ERRORS]


def __getattr__(name: str):
    if (name.isidentifier() and name not in _API_NAMES
            and importlib.util.find_spec(f"{__name__}.{name}") is not None):
        return importlib.import_module(f"{__name__}.{name}")  # a submodule (``jaxpg.ddp``)
    if name == "__all__" or not name.startswith("__"):
        _load_api()
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module 'jaxpg' has no attribute {name!r}")


def __dir__() -> list[str]:
    _load_api()
    return sorted(set(globals()) | set(_SUBPACKAGES))

