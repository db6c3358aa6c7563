"""jaxpg's internal tier, as ``equinox.internal``: helpers that jaxpg's own tests, benchmarks
and tools use, with no promise that they keep their names or signatures.

The public tiers are ``jaxpg`` (the torch.distributed surface) and the ``__all__`` of each
parallelism package; what is listed here is in neither. Importing this module loads the
parallelism packages (flax, optax).

* :func:`collective_counts`, :func:`collective_bytes`: the collectives of a compiled
  program's optimised HLO, counted and sized (the tensor-parallel tests and benchmark).
* :class:`MeshAxis`, :func:`resolve_mesh_axis`: a parallelism's group as one axis of the
  topology's mesh, and the one resolver that builds it (tensor, context, expert).
* :func:`fused_pmean`: DDP's unbucketed reduction (``reduction="fused_pmean"``).
* :func:`param_signature`: the shapes and dtypes DDP compares across ranks.
* ``KIND_CODES``: the integer code of each timetable action kind.
* :func:`free_port`: a free TCP port on this host, for starting test processes.
"""

from jaxpg.ddp.param_sync import param_signature
from jaxpg.ddp.reducer import fused_pmean
from jaxpg.groups.mesh_axis import MeshAxis, resolve_mesh_axis
from jaxpg.pipeline.schedule.timetable import KIND_CODES
from jaxpg.rendezvous.init_method import free_port
from jaxpg.tensor_parallel.hlo_counts import collective_bytes, collective_counts

__all__ = [
    "KIND_CODES", "MeshAxis", "collective_bytes", "collective_counts", "free_port", "fused_pmean",
    "param_signature", "resolve_mesh_axis",
]
