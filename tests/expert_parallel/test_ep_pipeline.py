"""Expert parallelism inside pipeline stages, run by the lockstep executor with
``param_specs``; the loss and every gradient against the un-pipelined model on one device:

* a ``("dp", "pp", "ep")`` mesh, each stage a block with an ``MoELayer`` over ``ep``
  (``replicated_tokens=True``: the stage's activations are the same on every ep rank, as in
  a tensor-parallel stage);
* a ``("pp", "dp")`` mesh whose data-parallel ranks are the expert-parallel group (EP
  borrowing DP, DeepSeek-V3's layout): each dp rank routes its own rows to the experts split
  over dp, the other parameters replicated and averaged.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpg
from jaxpg.expert_parallel import MoELayer
from jaxpg.pipeline import StagedParams, pipeline_value_and_grad
from jaxpg.pipeline.stage.nnx_stages import module_fn
from jaxpg.tensor_parallel import param_specs

D, F, E, STAGES, BATCH, SEQ = 8, 16, 4, 2, 8, 4


class Block(nnx.Module):
    def __init__(self, group, seed, replicated):
        rngs = nnx.Rngs(seed)
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.moe = MoELayer(D, F, E, top_k=2, group=group, rngs=rngs,
                            replicated_tokens=replicated)

    def __call__(self, x):
        return x + self.moe(self.ln(x))


def _embed(first, ids):
    return jnp.tanh(ids @ first["w"])


def _loss(last, y, targets):
    return jnp.mean((y @ last["w"] - targets) ** 2)


def _data():
    r = np.random.default_rng(0)
    first = {"w": jnp.asarray(r.normal(size=(D, D)) / 3, jnp.float32)}
    last = {"w": jnp.asarray(r.normal(size=(D, 3)) / 3, jnp.float32)}
    x = jnp.asarray(r.normal(size=(BATCH, SEQ, D)), jnp.float32)
    t = jnp.asarray(r.normal(size=(BATCH, SEQ, 3)), jnp.float32)
    return first, last, x, t


def _reference(x, t):
    """The un-pipelined model (every expert on one device): its stages' stacked arrays, the
    embedding and head, and the loss and gradients of all three on the whole batch."""
    one, _ = jaxpg.new_subgroups(group_size=1)
    blocks = [Block(one, 10 + s, False) for s in range(STAGES)]  # whole arrays, ep = 1
    first, last, _, _ = _data()
    graph = nnx.split(blocks[0])[0]
    # host copies: the one-device layers' arrays live on a one-rank group's mesh
    stages = jax.tree.map(lambda *a: jnp.asarray(np.stack([np.asarray(x) for x in a])),
                          *[nnx.state(b) for b in blocks])

    def reference(stages, first, last):
        h = _embed(first, x)
        for s in range(STAGES):
            h = nnx.merge(graph, jax.tree.map(lambda a, s=s: a[s], stages))(h)
        return _loss(last, h, t)

    want, want_grads = jax.jit(jax.value_and_grad(reference, argnums=(0, 1, 2)))(
        stages, first, last)
    return StagedParams(stages, first, last), want, want_grads


def _check(loss, grads, want, want_grads):
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    for got, exp in ((grads.stages, want_grads[0]), (grads.first, want_grads[1]),
                     (grads.last, want_grads[2])):
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(exp), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_moe_stages_of_a_dp_pp_ep_pipeline_equal_the_un_pipelined_model():
    mesh = jaxpg.init_device_mesh((2, 2, 2), ("dp", "pp", "ep"))
    _, _, x, t = _data()
    params, want, want_grads = _reference(x, t)
    template = Block(mesh["ep"], 10, True)  # the stage's code and one stage's specs
    ep_graph, ep_state = nnx.split(template)
    replicated = lambda tree: jax.tree.map(lambda _: P(), tree)  # noqa: E731
    specs = StagedParams(param_specs(ep_state), replicated(params.first),
                         replicated(params.last))
    loss, grads = pipeline_value_and_grad(
        module_fn(ep_graph), _loss, params, x, t, mesh=mesh,
        schedule="1f1b", num_microbatches=2, first_fn=_embed, param_specs=specs)
    _check(loss, grads, want, want_grads)


def experts_over_dp(mesh):
    """The pipeline over ``mesh`` (axes ``pp`` and ``dp``) with its MoE layers over
    ``mesh["dp"]``, the experts split over dp in ``param_specs``: ``(loss, grads)``, and the
    un-pipelined model's ``(loss, grads)`` on the whole batch (also run by
    tests/multiprocess/workers/pipeline_stage8_worker.py across processes)."""
    _, _, x, t = _data()
    params, want, want_grads = _reference(x, t)
    ep_graph, ep_state = nnx.split(Block(mesh["dp"], 10, False))
    specs = param_specs(ep_state)
    split = {str(k) for k, v in nnx.to_flat_state(specs) if "dp" in v}
    assert split == {"('moe', 'w1')", "('moe', 'w2')"}, split
    replicated = lambda tree: jax.tree.map(lambda _: P(), tree)  # noqa: E731
    specs = StagedParams(specs, replicated(params.first), replicated(params.last))
    loss, grads = pipeline_value_and_grad(
        module_fn(ep_graph), _loss, params, x, t, mesh=mesh,
        schedule="1f1b", num_microbatches=2, first_fn=_embed, param_specs=specs)
    return (loss, grads), (want, want_grads)


def test_experts_split_over_the_data_parallel_ranks_that_route_their_own_rows():
    """pp = 2 x dp = 4, the MoE layers over ``mesh["dp"]``: each dp rank pipelines its
    quarter of the batch and routes its rows to the experts of every dp rank (one each);
    ``param_specs`` name dp for the experts, whose gradients then hold every rank's rows
    (divided by dp), while the replicated parameters' are averaged over dp."""
    mesh = jaxpg.init_device_mesh((2, 4), ("pp", "dp"))
    (loss, grads), (want, want_grads) = experts_over_dp(mesh)
    _check(loss, grads, want, want_grads)
    w1 = grads.stages["moe"]["w1"]
    assert w1.sharding.spec == P("pp", "dp"), w1.sharding  # each rank keeps its expert's
