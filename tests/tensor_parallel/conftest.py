"""Tensor-parallel tests: an 8-rank world, and ("dp", "tp") meshes with tp = 2 and 4."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

import jaxpg


@pytest.fixture(autouse=True)
def fresh_world(world):
    """Every test here starts from a new 8-rank world (tests/conftest.py's ``world``)."""
    yield world


@pytest.fixture(params=[2, 4], ids=["tp2", "tp4"])
def mesh(request):
    """A DeviceMesh of the 8 ranks, ("dp", "tp") = (8 // tp, tp)."""
    return jaxpg.init_device_mesh((8 // request.param, request.param), ("dp", "tp"))


def spmd_grad(fn, mesh, state_specs, x_spec, *, reduce_loss: bool = False):
    """``jit(shard_map(value_and_grad(fn)))`` over ``mesh``: ``fn(state, x) -> scalar``,
    gradients for the state and the input; ``reduce_loss`` sums a per-rank partial loss."""

    def body(state, x):
        loss, grads = jax.value_and_grad(fn, argnums=(0, 1))(state, x)
        return (jax.lax.psum(loss, "tp") if reduce_loss else loss), grads

    return jax.jit(jax.shard_map(body, mesh=mesh.jax_mesh, in_specs=(state_specs, x_spec),
                                 out_specs=(P(), (state_specs, x_spec)), check_vma=False))
