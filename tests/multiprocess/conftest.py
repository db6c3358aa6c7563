"""Fixtures of the cluster tests: one Slurm per session, MPIwrapper built once."""

from __future__ import annotations

import pytest
from _cluster import Slurm, build_mpiwrapper, one_node_slurm


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> Slurm:
    """A one-node Slurm (munged, slurmctld, slurmd) for the whole session, stopped after."""
    with one_node_slurm(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def mpiwrapper() -> str:
    """The path of ``libmpiwrapper.so`` for this machine's Open MPI (built once, cached)."""
    return str(build_mpiwrapper())
