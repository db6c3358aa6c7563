"""The world a launcher made, read from its environment: torchrun, Slurm, Open MPI, MPICH.

:func:`detect_launcher` looks, in torch's order of precedence after explicit arguments:

1. ``RANK`` (with ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): torchrun, ``jaxpg-run``,
   Kubernetes' PyTorchJob. These win over everything below, so ``jaxpg-run`` started by
   ``srun`` or ``mpirun`` gives its workers its own world.
2. Slurm, inside a job step started by ``srun``: ``SLURM_PROCID``, ``SLURM_NTASKS`` (the
   step's ``SLURM_STEP_NUM_TASKS`` when set), ``SLURM_LOCALID``, ``SLURM_STEP_NODELIST``.
   A batch script itself (``sbatch``) has ``SLURM_NTASKS`` but no step node list: it is one
   process, not a world.
3. Open MPI's ``mpirun``: ``OMPI_COMM_WORLD_RANK``/``SIZE``/``LOCAL_RANK``/``LOCAL_SIZE``;
   MPICH's (Hydra) ``PMI_RANK``/``PMI_SIZE`` with ``MPI_LOCALRANKID``/``MPI_LOCALNRANKS``.

When Slurm's and an MPI launcher's variables are both present and disagree, the MPI
launcher's win: ``mpirun`` inside an allocation starts its ranks under Slurm, so they
inherit Slurm's variables of the batch step (or of the step that started Open MPI's
daemons), which describe other processes. When they agree (``srun --mpi=pmi2``), Slurm's
node list gives the coordinator.

The coordinator (JAX's coordination service, hosted for rank 0) is ``MASTER_ADDR`` /
``MASTER_PORT`` when set; else, as ``jax.distributed``'s cluster detection does, the first
node of the Slurm step (``node[001-004]`` -> ``node001``) or ``mpirun``'s host (Open MPI's
``OMPI_MCA_orte_hnp_uri``), or ``127.0.0.1`` when every rank runs on this machine, on a port
derived from the job's id in 61440-65535 (outside Linux's default ephemeral range), so that
every process computes the same one.
"""

from __future__ import annotations

import dataclasses
import os
import re
import zlib
from collections.abc import Mapping

__all__ = ["LauncherWorld", "detect_launcher", "first_host", "tasks_per_node"]

_PORT_BASE, _PORT_SPAN = 61440, 4096


@dataclasses.dataclass(frozen=True, kw_only=True)
class LauncherWorld:
    """This process's place in the world its launcher started.

    Attributes:
        launcher: ``"torchrun"`` (``RANK``/``WORLD_SIZE``: torchrun, jaxpg-run, PyTorchJob),
            ``"slurm"``, ``"openmpi"`` or ``"mpich"``.
        rank: this process's index in the world.
        world_size: the number of processes.
        local_rank: its index on this machine.
        local_world_size: the number of processes on this machine.
        coordinator: ``"host:port"`` of the coordinator, or None where the launcher's
            variables do not give one (``jaxpg.rendezvous`` then names what to set).
        variables: the variables it was read from, as ``NAME=value`` text for messages.
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    coordinator: str | None
    variables: str


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"The environment variable {name}={raw!r} must be an integer.") from None


def _shown(environ: Mapping[str, str], names: tuple[str, ...]) -> str:
    return ", ".join(f"{n}={environ[n]}" for n in names if n in environ)


def _split_top(text: str) -> list[str]:
    """Splits a Slurm host list at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``"node[001-004,9],gpu1"`` -> ``"node001"``.

    Each bracket takes its first number, zero padding kept (``"r[1-2]n[07-08]"`` -> ``"r1n07"``).

    Raises:
        ValueError: the list is empty or its brackets do not close.
    """
    items = _split_top(nodelist)
    if not items:
        raise ValueError(f"SLURM_STEP_NODELIST={nodelist!r} names no host.")
    item = items[0]
    if item.count("[") != item.count("]"):
        raise ValueError(f"SLURM_STEP_NODELIST={nodelist!r}: unbalanced brackets in {item!r}.")
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0].strip(), item)


def tasks_per_node(spec: str) -> list[int]:
    """Expands Slurm's ``SLURM_STEP_TASKS_PER_NODE``: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    out: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={spec!r} is not like '2(x3),1'.")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _port(environ: Mapping[str, str], job_key: str) -> int:
    """``MASTER_PORT`` if set, else a port every process of the job derives the same."""
    given = _int(environ, "MASTER_PORT")
    if given is not None:
        return given
    return _PORT_BASE + zlib.crc32(job_key.encode()) % _PORT_SPAN


def _slurm(environ: Mapping[str, str]) -> LauncherWorld | None:
    if "SLURM_STEP_NODELIST" not in environ or "SLURM_PROCID" not in environ:
        return None  # not inside an srun step (a batch script is one process)
    size = _int(environ, "SLURM_STEP_NUM_TASKS", _int(environ, "SLURM_NTASKS"))
    if size is None:
        raise ValueError(
            "Inside a Slurm step (SLURM_STEP_NODELIST is set) but neither SLURM_STEP_NUM_TASKS "
            "nor SLURM_NTASKS is: start the job step with srun."
        )
    rank = _int(environ, "SLURM_PROCID")
    local_rank = _int(environ, "SLURM_LOCALID", 0)
    local_size = 1
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if spec:
        counts = tasks_per_node(spec)
        node = _int(environ, "SLURM_NODEID", 0)
        local_size = counts[node] if 0 <= node < len(counts) else counts[0]
    host = environ.get("MASTER_ADDR") or first_host(environ["SLURM_STEP_NODELIST"])
    job = f"slurm:{environ.get('SLURM_JOB_ID', '')}.{environ.get('SLURM_STEP_ID', '')}"
    names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID",
             "SLURM_STEP_NODELIST", "SLURM_JOB_ID", "SLURM_STEP_ID")
    return LauncherWorld(launcher="slurm", rank=rank, world_size=size, local_rank=local_rank,
                         local_world_size=max(local_size, local_rank + 1),
                         coordinator=f"{host}:{_port(environ, job)}",
                         variables=_shown(environ, names))


def _hnp_host(uri: str) -> str | None:
    """``mpirun``'s first address in Open MPI 4's ``OMPI_MCA_orte_hnp_uri``."""
    m = re.search(r"tcp://([^,:;]+)|tcp6://\[([^,\]]+)", uri)
    return None if m is None else next(g for g in m.groups() if g)


def _mpi(environ: Mapping[str, str]) -> LauncherWorld | None:
    if "OMPI_COMM_WORLD_RANK" in environ and "OMPI_COMM_WORLD_SIZE" in environ:
        launcher, prefix = "openmpi", "OMPI_COMM_WORLD_"
        names = (f"{prefix}RANK", f"{prefix}SIZE", f"{prefix}LOCAL_RANK", f"{prefix}LOCAL_SIZE")
        rank, size = _int(environ, names[0]), _int(environ, names[1])
        local_rank = _int(environ, names[2], 0)
        local_size = _int(environ, names[3], size)
        uri = environ.get("OMPI_MCA_orte_hnp_uri", "")
        job = environ.get("PMIX_NAMESPACE") or uri.split(".", 1)[0]
        remote = _hnp_host(uri)
    elif "PMI_RANK" in environ and "PMI_SIZE" in environ:
        launcher = "mpich"
        names = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
        rank, size = _int(environ, names[0]), _int(environ, names[1])
        local_rank = _int(environ, names[2], 0)
        local_size = _int(environ, names[3], size)
        # Hydra's ranks on one machine are children of its one proxy there
        job = environ.get("PMI_KVSNAME") or environ.get("PMI_JOBID") or f"ppid:{os.getppid()}"
        remote = None
    else:
        return None
    if environ.get("MASTER_ADDR"):
        host = environ["MASTER_ADDR"]
    elif local_size == size:
        host = "127.0.0.1"  # every rank is on this machine
    else:
        host = remote
    port = _port(environ, f"{launcher}:{job}")
    return LauncherWorld(launcher=launcher, rank=rank, world_size=size, local_rank=local_rank,
                         local_world_size=local_size,
                         coordinator=None if host is None else f"{host}:{port}",
                         variables=_shown(environ, names))


def detect_launcher(environ: Mapping[str, str] | None = None) -> LauncherWorld | None:
    """The world this process's launcher started, or None when no launcher variables are set.

    ``RANK`` wins (torchrun, jaxpg-run); then Slurm's step, or an MPI launcher's world (see
    the module docstring for which when both are present). Only the torchrun form can lack
    a coordinator (``MASTER_ADDR``), which ``jaxpg.rendezvous`` then asks for.

    Args:
        environ: the environment to read (default ``os.environ``).

    Raises:
        ValueError: a launcher variable is not an integer, or a Slurm node list is malformed.
    """
    environ = os.environ if environ is None else environ
    if environ.get("RANK", "").strip():
        rank, size = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
        if size is None:
            raise ValueError(
                f"RANK={environ['RANK']!r} is set but WORLD_SIZE is not; a launcher sets both "
                "(with MASTER_ADDR and MASTER_PORT). Set WORLD_SIZE, or unset RANK."
            )
        address = None
        if environ.get("MASTER_ADDR") and environ.get("MASTER_PORT"):
            address = f"{environ['MASTER_ADDR']}:{_int(environ, 'MASTER_PORT')}"
        return LauncherWorld(launcher="torchrun", rank=rank, world_size=size,
                             local_rank=_int(environ, "LOCAL_RANK", rank),
                             local_world_size=_int(environ, "LOCAL_WORLD_SIZE", size),
                             coordinator=address,
                             variables=_shown(environ, ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                        "MASTER_PORT")))
    slurm, mpi = _slurm(environ), _mpi(environ)
    if slurm is not None and mpi is not None:
        same = (slurm.rank, slurm.world_size) == (mpi.rank, mpi.world_size)
        found = slurm if same else mpi
    else:
        found = slurm or mpi
    if found is None:
        return None
    if not 0 <= found.rank < found.world_size:
        raise ValueError(f"{found.launcher}'s variables give rank {found.rank} outside "
                         f"[0, {found.world_size}) ({found.variables}).")
    size = _int(environ, "WORLD_SIZE")
    if size is not None and size != found.world_size:
        raise ValueError(
            f"WORLD_SIZE={size} disagrees with the {found.launcher} world of "
            f"{found.world_size} processes ({found.variables}); unset WORLD_SIZE or make "
            "it match."
        )
    return found
