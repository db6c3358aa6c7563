"""Backend names (gloo, mpi, nccl, xla) and the check that a choice is possible here."""

from __future__ import annotations

import jax

__all__ = ["Backend", "resolve_backend"]


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
