"""Helpers for DDP tests: run a per-rank function under shard_map on n devices."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P


def _run_spmd(fn, n, *per_rank_args, check_vma=True):
    """Runs ``fn`` once per rank on ``n`` devices of a ('dp',) mesh.

    Every argument leaf carries a leading rank axis of size ``n``; ``fn`` sees
    the rank's slice without it. Outputs come back stacked along a new leading
    rank axis (numpy arrays).
    """
    mesh = Mesh(np.array(jax.devices()[:n]), ("dp",))

    def body(*args):
        local = jax.tree_util.tree_map(lambda x: x[0], args)
        out = fn(*local)
        return jax.tree_util.tree_map(lambda x: x[None], out)

    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"), check_vma=check_vma
    )
    out = jax.jit(mapped)(*per_rank_args)
    return jax.tree_util.tree_map(np.asarray, out)


@pytest.fixture
def spmd():
    """``spmd(fn, n, *per_rank_args)``: see :func:`_run_spmd`."""
    return _run_spmd
