"""``MoELayer``: each rank holds exactly its slice of the unsharded layer built with the same
seed, and the layer inside ``shard_map`` over a ("dp", "ep") mesh equals the unsharded one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpg
from jaxpg.expert_parallel import MoELayer
from jaxpg.tensor_parallel import param_specs

D, F, E = 8, 16, 8


@pytest.mark.parametrize("ep", [2])  # ep=4: test_moe.py
def test_layer_holds_its_slice_and_matches_the_unsharded_layer(ep):
    mesh = jaxpg.init_device_mesh((8 // ep, ep), ("dp", "ep"))
    layer = MoELayer(D, F, E, top_k=2, group=mesh.get_group("ep"), rngs=nnx.Rngs(3))
    one, _ = jaxpg.new_subgroups(group_size=1)
    full = MoELayer(D, F, E, top_k=2, group=one, rngs=nnx.Rngs(3))
    assert layer.num_local_experts == E // ep and full.num_local_experts == E
    for name in ("w1", "w2"):
        value, want = getattr(layer, name)[...], np.asarray(getattr(full, name)[...])
        assert value.sharding.spec == P("ep", None, None)
        for shard in value.addressable_shards:
            assert shard.data.shape[0] == E // ep
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    np.testing.assert_array_equal(np.asarray(layer.gate_weight[...]), full.gate_weight[...])

    x = np.random.default_rng(0).normal(size=(8, 3, D)).astype(np.float32)  # (batch, seq, d)
    graphdef, state = nnx.split(layer)
    specs = param_specs(state)

    def per_rank(state, x):
        def loss(state):
            y, aux = nnx.merge(graphdef, state)(x, return_aux=True)
            return jnp.sum(y ** 2) + aux.loss, y
        (_, y), grads = jax.value_and_grad(loss, has_aux=True)(state)
        return y, grads

    run = jax.jit(jax.shard_map(per_rank, mesh=mesh.jax_mesh, in_specs=(specs, P(("dp", "ep"))),
                                out_specs=(P(("dp", "ep")), P(("dp", "ep"))), check_vma=False))
    y, grads = run(state, x)
    graphdef1, state1 = nnx.split(full)
    rows = np.split(x, 8 // ep)  # one dp group's tokens each: the aux loss is per group

    def want_loss(state1):
        total = 0.0
        for part in rows:
            out, aux = nnx.merge(graphdef1, state1)(jnp.asarray(part), return_aux=True)
            total = total + jnp.sum(out ** 2) + aux.loss * ep  # every ep rank adds its copy
        return total

    want_y = np.concatenate([np.asarray(full(jnp.asarray(p))) for p in rows])
    np.testing.assert_allclose(np.asarray(y), want_y, rtol=1e-5, atol=1e-5)
    want_grads = jax.jit(jax.grad(want_loss))(state1)
    # Expert gradients: rank (i, j)'s experts' gradient from dp group i; summed over dp.
    g1 = np.asarray(grads["w1"][...]).reshape(8 // ep, ep, E // ep, D, F).sum(0)
    np.testing.assert_allclose(g1.reshape(E, D, F), want_grads["w1"][...], rtol=1e-4,
                               atol=1e-5)
    # The router's gradient: every rank's part summed.
    gg = np.asarray(grads["gate_weight"][...]).reshape(8, D, E).sum(0)
    np.testing.assert_allclose(gg, want_grads["gate_weight"][...], rtol=1e-4, atol=1e-5)
