"""How a job's processes find each other: torch's ``init_method`` forms and the launchers'
environments (torchrun/jaxpg-run, Slurm, Open MPI, MPICH).

* :mod:`~jaxpg.rendezvous.init_method`: ``env://``, ``tcp://``, ``file://`` or a store ->
  a :class:`RendezvousInfo`; starting and stopping ``jax.distributed`` from it.
* :mod:`~jaxpg.rendezvous.cluster_env`: the world ``srun`` or ``mpirun`` made, read from
  their variables (:func:`detect_launcher`).
* :mod:`~jaxpg.rendezvous.mpi_collectives`: XLA's MPI collectives for ``backend="mpi"``.
"""

from jaxpg.rendezvous.cluster_env import LauncherWorld, detect_launcher
from jaxpg.rendezvous.init_method import (
    RendezvousInfo,
    initialize_jax_distributed,
    rendezvous,
    shutdown_jax_distributed,
)

__all__ = [
    "LauncherWorld",
    "RendezvousInfo",
    "detect_launcher",
    "initialize_jax_distributed",
    "rendezvous",
    "shutdown_jax_distributed",
]
