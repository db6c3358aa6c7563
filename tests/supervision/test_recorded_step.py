"""recorded_step in one process: the collectives read from compiled HLO, the group a mesh
is numbered on, and a wrapper that changes nothing outside a multi-process world."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxpg
from jaxpg.supervision.step_recording import group_of_devices, hlo_collectives


def _program(mesh):
    def body(x):
        total = jax.lax.psum(x, "i")
        gathered = jax.lax.all_gather(x, "i", tiled=True)
        shifted = jax.lax.ppermute(x, "i", [(i, (i + 1) % 8) for i in range(8)])
        return total + shifted, gathered

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=(P("i"), P()),
                                 check_vma=False))


def test_collectives_are_read_from_the_compiled_hlo():
    mesh = Mesh(np.array(jax.devices()), ("i",))
    x = jnp.arange(16.0).reshape(16, 1)
    found = hlo_collectives(_program(mesh).lower(x).compile().as_text())
    ops = [c.split()[0] for c in found]
    assert {"all-reduce", "all-gather", "collective-permute"} <= set(ops), found
    assert "all-gather f32[16,1]" in found, found


def test_hlo_text_forms_layouts_tuples_async_starts_and_repeats():
    hlo = """
  %all-reduce.1 = f32[10,4]{1,0} all-reduce(f32[10,4]{1,0} %p), channel_id=1, to_apply=%add
  %ar2 = (f32[4]{0}, bf16[]) all-reduce-start(%a, %b), replica_groups={{0,1}}
  %ar3 = f32[10,4]{1,0} all-reduce(%q), channel_id=3
  %x = f32[8] add(%all-reduce.1, %c)
  ROOT %rs = f32[2,4]{1,0} reduce-scatter(%r), dimensions={0}
"""
    assert hlo_collectives(hlo) == ("all-reduce f32[10,4] x2", "all-reduce (f32[4], bf16[])",
                                    "reduce-scatter f32[2,4]")


def test_a_mesh_is_numbered_on_the_world_or_on_the_group_of_its_devices(world):
    state = world._world
    assert group_of_devices(state, jax.devices()) is world
    part = group_of_devices(state, jax.devices()[:4])
    assert part.group_name == "devices_0-3" and part.ranks == (0, 1, 2, 3)
    assert group_of_devices(state, jax.devices()[3::-1]) is part  # the same group again
    odd = group_of_devices(state, [jax.devices()[i] for i in (1, 5, 6)])
    assert odd.ranks == (1, 5, 6) and odd.group_name.startswith("devices_")


def test_outside_a_multiprocess_world_a_recorded_step_is_the_function(world):
    mesh = Mesh(np.array(jax.devices()), ("i",))
    fn = _program(mesh)
    step = jaxpg.supervision.recorded_step(fn, mesh, name="my_step")
    x = jnp.arange(16.0).reshape(16, 1)
    for got, want in zip(step(x), fn(x)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert step.name == "my_step" and step.lower(x).compile() is not None  # fn's attributes
    assert jax.jit(lambda y: step(y)[0])(x).shape == (16, 1)  # traced: passes through

    def inner(y):
        return y + 1

    assert jaxpg.supervision.recorded_step(jax.jit(inner)).name == "inner"  # no "<locals>" in it
    decorated = jaxpg.supervision.recorded_step(group=world, name="dec")(jax.jit(inner))
    assert decorated.name == "dec" and float(decorated(1.0)) == 2.0


@pytest.mark.parametrize("kwargs, match", [
    ({"fn": 3}, "fn=3 must be callable"),
    ({"fn": abs, "group": "WORLD"}, "group='WORLD' must be a ProcessGroup, a jax.sharding.Mesh"),
    ({"fn": abs, "name": ""}, "name='' must be a non-empty string"),
])
def test_bad_arguments_are_named(world, kwargs, match):
    with pytest.raises(TypeError, match=match):
        jaxpg.supervision.recorded_step(**kwargs)


def test_ddp_and_the_pipeline_record_their_steps(world):
    import optax
    from flax import nnx

    from jaxpg.ddp.train_step import StepMode
    from jaxpg.pipeline.train_step import make_train_step
    from jaxpg.supervision.step_recording import RecordedStep

    step = make_train_step(lambda w, x: x @ w, lambda h, y, t: jnp.mean((y - t) ** 2),
                           optax.sgd(0.1), mesh=jaxpg.ParallelDims(dp_replicate=4, pp=2),
                           num_microbatches=2)
    assert isinstance(step, RecordedStep) and step.name == "pipeline.train_step"
    ddp = jaxpg.ddp.DistributedDataParallel(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1))
    ddp_step = ddp._step_fn(lambda m, b: m(b).sum(), StepMode())
    assert isinstance(ddp_step, RecordedStep)
    assert (ddp_step.name, ddp_step.group) == ("DistributedDataParallel.train_step", world)
