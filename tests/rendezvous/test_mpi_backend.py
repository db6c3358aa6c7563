"""backend="mpi" refuses to start, with what to build and set, before anything can end the
process: an unset, wrong or late MPITRAMPOLINE_LIB (jaxlib's MPItrampoline would exit)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import jaxpg
from jaxpg.errors import DistBackendError
from jaxpg.runtime import mpi_library


def test_library_problems_are_named(tmp_path):
    assert "absolute" in mpi_library.library_problem("libmpiwrapper.so")
    assert mpi_library.library_problem(str(tmp_path / "none.so")) == "no such file"
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert "not a shared library" in mpi_library.library_problem(str(text))
    other = os.path.realpath(sys.executable)  # an ELF file, but no MPIwrapper
    assert "not an MPIwrapper library" in mpi_library.library_problem(other)
    fake = tmp_path / "libmpiwrapper.so"
    fake.write_bytes(b"\x7fELF....mpiwrapper_version_major\0")
    assert mpi_library.library_problem(str(fake)) is None


def test_a_wrong_library_fails_import_jaxpg_with_the_fix_not_import_jax_with_an_exit(tmp_path):
    env = dict(os.environ, MPITRAMPOLINE_LIB=str(tmp_path / "missing.so"), JAX_PLATFORMS="cpu")
    plain = subprocess.run([sys.executable, "-c", "import jax"], env=env, capture_output=True,
                           text=True, timeout=120)
    assert plain.returncode != 0 and "MPItrampoline" in plain.stderr  # what jaxpg prevents
    ours = subprocess.run([sys.executable, "-c", "import jaxpg"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert ours.returncode == 1
    assert "ImportError: MPITRAMPOLINE_LIB=" in ours.stderr and "no such file" in ours.stderr
    assert "Build MPIwrapper" in ours.stderr and "MPItrampoline:" not in ours.stderr


@pytest.fixture
def launcher_world(monkeypatch):
    """A torchrun world of two whose peer never comes: the check must come before it.

    It starts from no world: a test before it in this process may have left one (an
    ``init_device_mesh`` call starts the default group, as torch's does)."""
    if jaxpg.is_initialized():
        jaxpg.destroy_process_group()
    for name, value in dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="9").items():
        monkeypatch.setenv(name, value)
    yield monkeypatch
    assert not jaxpg.is_initialized()


def test_unset_library_is_refused_before_the_rendezvous(launcher_world):
    launcher_world.delenv("MPITRAMPOLINE_LIB", raising=False)
    with pytest.raises(DistBackendError, match="MPITRAMPOLINE_LIB, and it is not set") as err:
        jaxpg.init_process_group(backend="mpi")
    assert "cmake" in str(err.value) and "mpirun -x MPITRAMPOLINE_LIB" in str(err.value)


def test_library_set_after_jax_was_imported_is_refused(launcher_world, tmp_path):
    fake = tmp_path / "libmpiwrapper.so"
    fake.write_bytes(b"\x7fELF....mpiwrapper_version_major\0")
    launcher_world.setenv("MPITRAMPOLINE_LIB", str(fake))
    with pytest.raises(DistBackendError, match="not loaded in this process"):
        jaxpg.init_process_group(backend="cpu:mpi")
    launcher_world.setenv("MPITRAMPOLINE_LIB", str(tmp_path / "missing.so"))
    with pytest.raises(DistBackendError, match="no such file"):
        jaxpg.init_process_group(backend="mpi")


def test_mpis_world_and_one_device_per_process_are_checked_after_the_start(monkeypatch):
    """What init_process_group(backend='mpi') checks once JAX's CPU client started
    (docs/cluster.md): MPI started, MPI's world is the launcher's, one device per process."""
    from jaxpg.rendezvous import mpi_collectives

    monkeypatch.setattr(mpi_collectives, "_mpi_world", None)
    with pytest.raises(DistBackendError, match="started without jaxpg's MPI collectives"):
        mpi_collectives.check_started(0, 2, 1)
    monkeypatch.setattr(mpi_collectives, "_mpi_world", (1, 2))  # rank 1 of 2 to MPI
    mpi_collectives.check_started(1, 2, 1)  # mpirun's world, one device: accepted
    with pytest.raises(DistBackendError, match=r"MPI sees this process as rank 1 of 2, but "
                                               r"the world has 3 processes \(this one is 1\)"):
        mpi_collectives.check_started(1, 3, 1)
    with pytest.raises(DistBackendError, match=r"backend='mpi' runs one device per process "
                                               r".*but this process has 8; start one process "
                                               r"per device"):
        mpi_collectives.check_started(1, 2, 8)
