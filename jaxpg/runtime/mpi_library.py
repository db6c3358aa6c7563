"""The MPI library that jax's MPI collectives load (``MPITRAMPOLINE_LIB``), checked early.

jaxlib links MPItrampoline, which, *when jaxlib is imported*, loads the library named by
``MPITRAMPOLINE_LIB``: a ``libmpiwrapper.so`` built with MPIwrapper against the MPI that
``mpirun`` belongs to. Its failures are not exceptions:

* set to a missing file, or to a library that is not an MPIwrapper: ``import jax`` itself
  prints ``MPItrampoline: Could not dlopen library ...`` and ends the process (status 1);
* unset, or set from Python after jax was imported: the first use of the MPI collectives
  prints ``The environment variable MPITRAMPOLINE_LIB is not set`` and ends the process.

So jaxpg checks before either can happen. :func:`check_before_jax_import` runs when this
module is imported, which ``import jaxpg`` does first (this module imports nothing that
loads jax); it raises ``ImportError``
for a set-but-wrong ``MPITRAMPOLINE_LIB``; :func:`require_loaded` runs at
``init_process_group(backend="mpi")`` and raises ``DistBackendError`` unless the library is
set, valid and loaded into this process. Both messages say what to build and set.
"""

from __future__ import annotations

import os
import sys

from jaxpg.errors import DistBackendError

__all__ = ["ENV_VAR", "build_instructions", "check_before_jax_import", "library_problem",
           "loaded_path", "require_loaded"]

ENV_VAR = "MPITRAMPOLINE_LIB"
_MARK = b"mpiwrapper_version_major"  # a symbol every MPIwrapper exports (MPItrampoline reads it)


def build_instructions() -> str:
    """What to build and set, for the error messages."""
    return (
        "Build MPIwrapper (https://github.com/eschnett/MPIwrapper, version 2.10 or later) "
        "against the MPI whose mpirun starts the job (Debian: apt-get install openmpi-bin "
        "libopenmpi-dev gfortran cmake): `cmake -S MPIwrapper-2.11.1 -B build "
        "-DMPIEXEC_EXECUTABLE=$(command -v mpiexec) -DCMAKE_INSTALL_PREFIX=$HOME/mpiwrapper "
        "&& cmake --build build && cmake --install build`; then export "
        "MPITRAMPOLINE_LIB=$HOME/mpiwrapper/lib/libmpiwrapper.so before Python starts (with "
        "mpirun: `mpirun -x MPITRAMPOLINE_LIB ...`). See docs/cluster.md."
    )


def library_problem(path: str) -> str | None:
    """What is wrong with ``path`` as an MPIwrapper library, or None if it looks right.

    Checks that it is a readable ELF shared object that exports MPIwrapper's version
    symbol (the first thing MPItrampoline resolves), without loading it.
    """
    if not os.path.isabs(path):
        return "it must be an absolute path"
    if not os.path.isfile(path):
        return "no such file"
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        return f"it cannot be read ({err.strerror})"
    if not data.startswith(b"\x7fELF"):
        return "it is not a shared library (ELF)"
    if _MARK not in data:
        return ("it is not an MPIwrapper library (it exports no mpiwrapper_version_major; "
                "MPITRAMPOLINE_LIB must name libmpiwrapper.so, not the MPI library itself)")
    return None


def check_before_jax_import() -> None:
    """Raises ``ImportError`` if ``MPITRAMPOLINE_LIB`` is set to something jaxlib's
    MPItrampoline would fail to load when jax is imported (which ends the process).

    Does nothing when the variable is unset (the gloo backend needs nothing) or jaxlib
    is already imported (too late: it either loaded the library or ended the process).
    """
    path = os.environ.get(ENV_VAR)
    if not path or "jaxlib" in sys.modules:
        return
    problem = library_problem(path)
    if problem is not None:
        raise ImportError(
            f"{ENV_VAR}={path!r}: {problem}. jaxlib loads this library when jax is imported "
            f"and ends the process if it cannot. Unset {ENV_VAR} to use the gloo backend, or "
            f"point it at an MPIwrapper build. {build_instructions()}"
        )


def loaded_path() -> str | None:
    """The ``libmpiwrapper`` mapped into this process (``/proc/self/maps``), or None.

    Returns ``""`` where ``/proc/self/maps`` cannot be read (not Linux): unknown.
    """
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return ""
    wanted = os.path.realpath(os.environ.get(ENV_VAR, "")) if os.environ.get(ENV_VAR) else None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and (fields[5] == wanted or "libmpiwrapper" in fields[5]):
            return fields[5]
    return None


def require_loaded() -> str:
    """Checks that jax's MPI collectives can start, and returns the library's path.

    Raises:
        DistBackendError: ``MPITRAMPOLINE_LIB`` is unset, names a bad file, or was set
            after jax was imported (the library is not loaded in this process).
    """
    path = os.environ.get(ENV_VAR)
    if not path:
        raise DistBackendError(
            f"backend='mpi' uses XLA's MPI collectives, which load the MPI library named by "
            f"{ENV_VAR}, and it is not set. {build_instructions()}"
        )
    problem = library_problem(path)
    if problem is not None:
        raise DistBackendError(f"backend='mpi': {ENV_VAR}={path!r}: {problem}. "
                               f"{build_instructions()}")
    if loaded_path() is None:
        raise DistBackendError(
            f"backend='mpi': {ENV_VAR}={path!r} is a valid MPIwrapper library, but it is not "
            "loaded in this process: jaxlib loads it once, when jax is imported, so the "
            "variable must be set before Python starts (in the shell, the batch script, or "
            f"`mpirun -x {ENV_VAR}`), not from Python."
        )
    return path


check_before_jax_import()  # importing this module checks (``import jaxpg`` does it first)
