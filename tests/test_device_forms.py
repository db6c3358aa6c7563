"""Every API that takes devices accepts the documented forms alike (docs/mesh.md), in the
one-process layout (8 ranks in one process); the one-device-per-process layout is
tests/multiprocess/test_device_forms_mp.py. Each form's result is checked against a naive
reference (numpy over the ranks, one-device training on the whole batch)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxpg

ORDER = ("dp_replicate", "pp", "dp_shard", "cp", "tp")


@pytest.fixture
def dims(world):
    return jaxpg.ParallelDims(dp_shard=4, tp=2)


def axis_forms(dims, name):
    """One axis, as each API's group= takes it."""
    return {"ProcessGroup": dims.get_group(name), "1-D DeviceMesh": dims[name]}


def mesh_forms(dims):
    """Several axes, as each API's mesh= takes it."""
    jm = Mesh(np.array(jax.devices()).reshape(dims.device_mesh.shape), ORDER)
    return {"DeviceMesh": dims.device_mesh, "ParallelDims": dims, "jax Mesh": jm}


def tp_sums(x):
    """numpy reference: each rank's row summed over its tp pair (tp innermost)."""
    return np.repeat(x.reshape(4, 2, -1).sum(1), 2, axis=0)


def test_collectives_and_spmd_group(dims):
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    for name, form in axis_forms(dims, "tp").items():
        eager = jaxpg.all_reduce(jnp.asarray(x), group=form)
        np.testing.assert_array_equal(np.asarray(eager), tp_sums(x), err_msg=name)
        traced = jaxpg.spmd(lambda v, g=form: jaxpg.all_reduce(v, group=g))(x)
        np.testing.assert_array_equal(np.asarray(traced), tp_sums(x), err_msg=name)
        assert jaxpg.get_world_size(form) == 2
        # a family's groups run together, one row per rank; get_rank(g): the rank in g, -1
        # outside it (g is the acting rank's group)
        ranks = jaxpg.spmd(lambda v, g=form: v + jaxpg.get_rank(g), group=form)(np.zeros(8))
        want = [dims.get_group("tp").group_rank(r) for r in range(8)]
        np.testing.assert_array_equal(np.asarray(ranks), want, err_msg=name)


def test_spmd_mesh(dims):
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    hcg = jaxpg.HybridCommunicateGroup(sharding_degree=4, mp_degree=2)
    cases = {k: (v, dims.get_group("tp"), ORDER) for k, v in mesh_forms(dims).items()}
    cases["HybridCommunicateGroup"] = (hcg, hcg.get_model_parallel_group(),
                                       hcg.device_mesh.mesh_dim_names)
    for name, (form, tp, axes) in cases.items():
        f = jaxpg.spmd(lambda v, g=tp: jaxpg.all_reduce(v, group=g), mesh=form,
                       in_specs=P(axes), out_specs=P(axes))
        np.testing.assert_array_equal(np.asarray(f(x)), tp_sums(x), err_msg=name)


def _mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _batch():
    k1, k2 = jax.random.split(jax.random.key(1))
    return {"x": jax.random.normal(k1, (16, 4)), "y": jax.random.normal(k2, (16, 2))}


def _reference_step():
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    grads = nnx.grad(_mse)(model, _batch())
    params = nnx.state(model, nnx.Param)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def _one_step(wrapper_cls, **kwargs):
    wrapper = wrapper_cls(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1), **kwargs)
    wrapper.train_step(_mse, _batch())
    return nnx.state(wrapper.module, nnx.Param)


def _assert_params(got, want, name):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6,
                                   err_msg=name)


def test_distributed_data_parallel(world):
    from jaxpg.ddp import DistributedDataParallel

    dims = jaxpg.ParallelDims(dp_replicate=8)
    want = _reference_step()
    forms = {"group=ProcessGroup": dict(group=dims.get_group("dp_replicate")),
             "group=mesh['dp']": dict(group=dims["dp"]),
             "device_mesh=": dict(device_mesh=dims["dp_replicate"])}
    for name, kwargs in forms.items():
        _assert_params(_one_step(DistributedDataParallel, **kwargs), want, name)


def test_fully_sharded_data_parallel(world):
    from jaxpg.fsdp import FullyShardedDataParallel

    dims = jaxpg.ParallelDims(dp_shard=8)
    want = _reference_step()
    forms = {"group=ProcessGroup": dict(group=dims.get_group("dp_shard")),
             "group=mesh['dp']": dict(group=dims["dp"]),
             "device_mesh=": dict(device_mesh=dims["dp_shard"]),
             "group=ParallelDims": dict(group=dims)}
    for name, kwargs in forms.items():
        _assert_params(_one_step(FullyShardedDataParallel, zero_stage=3, **kwargs), want, name)


def test_tensor_parallel(dims):
    from jaxpg.tensor_parallel import ColumnParallelLinear, ColwiseParallel, parallelize_module

    x = jax.random.normal(jax.random.key(2), (3, 4))
    dense = nnx.Linear(4, 6, rngs=nnx.Rngs(0))
    want = np.asarray(dense(x))
    forms = {**axis_forms(dims, "tp"), "ParallelDims": dims}
    for name, form in forms.items():
        model = parallelize_module(nnx.Linear(4, 6, rngs=nnx.Rngs(0)), form, ColwiseParallel())
        assert model.kernel[...].sharding.spec == P(None, "tp"), name
        np.testing.assert_allclose(np.asarray(model(x)), want, rtol=1e-5, err_msg=name)
        layer = ColumnParallelLinear(4, 6, mp_group=form, rngs=nnx.Rngs(0))
        assert layer.tp.axis == "tp" and layer.tp.size == 2, name


def test_pipeline(world):
    from jaxpg.pipeline import StagedParams, pipeline_value_and_grad

    def block(w, x):
        return jnp.tanh(x @ w)

    def head_loss(_, y, t):
        return jnp.mean((y - t) ** 2)

    ws = jax.random.normal(jax.random.key(3), (4, 3, 3)) * 0.5
    x, t = jax.random.normal(jax.random.key(4), (8, 3)), jax.random.normal(jax.random.key(5),
                                                                              (8, 3))

    def reference(ws):
        h = x
        for s in range(4):
            h = block(ws[s], h)
        return head_loss((), h, t)

    want_loss, want_grads = jax.value_and_grad(reference)(ws)
    forms = {"jax Mesh": Mesh(np.array(jax.devices()).reshape(2, 4), ("dp", "pp")),
             "DeviceMesh": jaxpg.init_device_mesh((2, 4), ("dp", "pp")),
             "ParallelDims": jaxpg.ParallelDims(dp_replicate=2, pp=4),
             "HybridCommunicateGroup": jaxpg.HybridCommunicateGroup(dp_degree=2, pp_degree=4)}
    for name, form in forms.items():
        loss, grads = pipeline_value_and_grad(
            block, head_loss, StagedParams(ws, (), ()), x, t, mesh=form, schedule="gpipe",
            num_microbatches=2)
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(np.asarray(grads.stages), np.asarray(want_grads),
                                   rtol=1e-5, atol=1e-6, err_msg=name)


def test_sync_batchnorm(dims):
    from jaxpg.ddp import sync_batchnorm_axis

    axes = {name: sync_batchnorm_axis(form) for name, form in axis_forms(dims, "dp").items()}
    assert set(axes.values()) == {dims.get_group("dp").axis_name}, axes


class _Mlp(nnx.Module):
    def __init__(self):
        self.up = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.down = nnx.Linear(8, 2, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def test_parallelize_on_tp_then_wrap_on_dp_of_one_parallel_dims(dims):
    from jaxpg.ddp import DistributedDataParallel
    from jaxpg.fsdp import FullyShardedDataParallel
    from jaxpg.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    ref = _Mlp()
    grads = nnx.grad(_mse)(ref, _batch())
    want = jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(ref, nnx.Param), grads)
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    for name, cls, kwargs in [("DDP group=dims['dp']", DistributedDataParallel,
                               dict(group=dims["dp"])),
                              ("FSDP group=dims", FullyShardedDataParallel, dict(group=dims))]:
        wrapper = cls(parallelize_module(_Mlp(), dims["tp"], plan), optax.sgd(0.1), **kwargs)
        wrapper.train_step(_mse, _batch())
        _assert_params(nnx.state(wrapper.module, nnx.Param), want, name)
