"""Backend names (gloo, mpi, nccl, xla), the check that a choice is possible here, and what
XLA's MPI collectives cannot do."""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["Backend", "mpi_unsupported", "names_mpi", "resolve_backend"]


class Backend(str):
    """A backend name, as ``torch.distributed.Backend``: ``Backend.GLOO == "gloo"``.

    jaxpg never moves tensor bytes itself: every backend is XLA's own collectives.
    ``gloo`` and ``mpi`` select the CPU collectives implementation between processes,
    ``nccl`` means XLA's NCCL collectives on NVIDIA GPUs, and ``xla`` takes whatever the
    platform provides (ICI on TPU, NCCL on GPU, gloo on CPU).
    """

    GLOO = "gloo"
    MPI = "mpi"
    NCCL = "nccl"
    XLA = "xla"

    def __new__(cls, name: str) -> Backend:
        if not isinstance(name, str):
            raise TypeError(f"backend must be a string such as 'gloo'; got {name!r}.")
        value = name.lower()
        if value not in (cls.GLOO, cls.MPI, cls.NCCL, cls.XLA):
            raise ValueError(
                f"backend={name!r} is not known; choose one of 'gloo', 'mpi', 'nccl' or 'xla' "
                "(or None to pick by platform)."
            )
        return super().__new__(cls, value)


def names_mpi(backend: str | None) -> bool:
    """Whether ``backend`` asks for MPI on CPU (``"mpi"`` or torch's ``"cpu:mpi,..."``)."""
    if not isinstance(backend, str):
        return False
    value = backend.lower().replace(" ", "")
    return value == "mpi" or "cpu:mpi" in value.split(",")


_PLATFORM_BACKENDS = {
    "cpu": (Backend.GLOO, Backend.MPI, Backend.XLA),
    "gpu": (Backend.NCCL, Backend.XLA),
    "cuda": (Backend.NCCL, Backend.XLA),
    "rocm": (Backend.NCCL, Backend.XLA),
    "tpu": (Backend.XLA,),
}
_DEFAULT_FOR_PLATFORM = {"cpu": Backend.GLOO, "gpu": Backend.NCCL, "cuda": Backend.NCCL}


def resolve_backend(backend: str | None, platform: str | None = None) -> Backend:
    """Returns the backend to use on ``platform``, checking that it can work there.

    Args:
        backend: a name, ``"cpu:gloo,cuda:nccl"`` (torch's per-device form), or None.
        platform: JAX's platform; defaults to ``jax.default_backend()``.

    Raises:
        ValueError: the backend cannot run on this platform (e.g. ``"nccl"`` with no GPU).
    """
    platform = platform or jax.default_backend()
    if backend is None:
        return _DEFAULT_FOR_PLATFORM.get(platform, Backend.XLA)
    if isinstance(backend, str) and ":" in backend:
        chosen = dict(part.split(":", 1) for part in backend.split(","))
        key = "cuda" if platform == "gpu" and "cuda" in chosen else platform
        if key not in chosen:
            raise ValueError(
                f"backend={backend!r} names no backend for this platform ({platform!r}); "
                f"add '{platform}:<name>'."
            )
        backend = chosen[key]
    result = Backend(backend)
    if result not in _PLATFORM_BACKENDS.get(platform, (Backend.XLA,)):
        allowed = ", ".join(repr(str(b)) for b in _PLATFORM_BACKENDS.get(platform, ("xla",)))
        raise ValueError(
            f"backend={backend!r} cannot run on JAX's {platform!r} platform "
            f"(jax.devices() = {jax.devices()[:2]}...); use one of {allowed}, or None."
        )
    return result


def mpi_unsupported(group: Any, api: str) -> NotImplementedError | None:
    """The error for a collective XLA's MPI collectives cannot run on ``group``, or None.

    XLA makes each MPI communicator with ``MPI_Comm_split`` over ``MPI_COMM_WORLD``, which
    every process must enter at the same point. A collective whose kernel runs on some but
    not all processes (``new_group`` of a subset, ``send``/``recv`` between two of more than
    two processes) would wait there forever, or pair up with another group's split and mix
    two groups' data. Families of subgroups that cover every process (``new_subgroups``, a
    ``DeviceMesh`` dimension) split together and work, as does everything inside
    ``jaxpg.spmd`` code, where every process runs the same program.
    """
    state = group._world
    procs = sorted({state.devices[r].process_index for r in group.members})
    if len(procs) in (1, state.process_count):
        return None
    return NotImplementedError(
        f"{api} on group {group.group_name!r} (ranks {list(group.ranks)}, processes {procs} "
        f"of {state.process_count}) is not available with backend='mpi': XLA's MPI "
        "collectives make every communicator with MPI_Comm_split over MPI_COMM_WORLD, which "
        "all processes must enter, so a collective that leaves processes out would hang or "
        "mix with another group's. With backend='mpi', use the world, subgroups that cover "
        "every process (new_subgroups, a DeviceMesh dimension; every process calls its own), "
        "or jaxpg.spmd code; for this group, use backend='gloo'."
    )
