"""jaxpg: torch.distributed's process groups, DDP and pipeline parallelism for JAX.

A rank is a device; a process group is an ordered set of devices (a Mesh). Every
collective runs eagerly from host code or, inside ``jaxpg.spmd``, lowers to ``lax``
collectives under ``shard_map``.
"""

import jaxpg.runtime.mpi_library  # noqa: F401  (first: checks MPITRAMPOLINE_LIB before jax is imported)
from jaxpg.collectives import *  # noqa: F403
from jaxpg.collectives import __all__ as _collectives_all
from jaxpg.errors import (
    DiscardedResultWarning,
    DistBackendError,
    DistDesyncError,
    DistError,
    DistNetworkError,
    DistStoreError,
    DistTimeoutError,
)
from jaxpg.groups import *  # noqa: F403
from jaxpg.groups import __all__ as _groups_all
from jaxpg.reduce_op import RedOpType, ReduceOp
from jaxpg.spmd import spmd
from jaxpg.stores import FileStore, HashStore, PrefixStore, Store, TCPStore

__version__ = "0.1.0"

__all__ = [
    *_collectives_all,
    *_groups_all,
    "DiscardedResultWarning", "DistBackendError", "DistDesyncError", "DistError",
    "DistNetworkError", "DistStoreError",
    "DistTimeoutError",
    "ReduceOp", "RedOpType", "spmd", "Store", "HashStore", "FileStore", "PrefixStore",
    "TCPStore",
]

# The parallelism packages load flax, optax and orbax: ``import jaxpg`` does not, and
# ``jaxpg.ddp`` (or ``import jaxpg.ddp``) imports the package on first use.
_SUBPACKAGES = ("ddp", "fsdp", "pipeline", "tensor_parallel")


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        import importlib

        return importlib.import_module(f"jaxpg.{name}")
    raise AttributeError(f"module 'jaxpg' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SUBPACKAGES))
