"""Fully sharded (FSDP, ZeRO-3) PipelineStages in one process, on the 8 simulated devices: a
``("pp", "dp_shard") = (2, 4)`` mesh, each of two unequal stages sharded over its 4 dp_shard
devices, their programs (the ones a schedule runs) driven microbatch by microbatch by hand.

Losses, gradients and an SGD step must equal the un-pipelined, un-sharded model's on the
whole batch (one device); the parameters and gradients must stay split over dp_shard, and
no forward may keep a gathered parameter for its backward. (Schedules across processes run
the same programs: tests/multiprocess/workers/pipeline_stage_tp_worker.py.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpg
from jaxpg.pipeline import PipelineStage
from jaxpg.pipeline.process.stage_runner import stage_programs

V, D, H, M, B = 12, 8, 16, 2, 16  # vocabulary, width, hidden, microbatches, batch


class EmbedMLP(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.fc1 = nnx.Linear(D, H, rngs=rngs)
        self.fc2 = nnx.Linear(H, D, rngs=rngs)
        self.scale = nnx.Param(jnp.asarray(1.5))  # 0-d: replicated, its gradient summed

    def __call__(self, tokens):
        h = self.embed(tokens)
        return h + self.scale * self.fc2(jax.nn.gelu(self.fc1(h)))


class NormHead(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.out = nnx.Linear(D, V, use_bias=False, rngs=rngs)

    def __call__(self, h):
        return self.out(self.norm(h))


def ce(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def modules():
    return EmbedMLP(nnx.Rngs(3)), NormHead(nnx.Rngs(4))


def reference(tokens, labels, stages=None, extra=()):
    """The whole model on the whole batch (one device): microbatch losses, each stage's
    gradient of their mean, and each stage's parameters after an SGD step. ``stages``: the
    two stage modules (default :func:`modules`'), the first taking ``(tokens, *extra)``."""
    graphs, params = zip(*(nnx.split(m, nnx.Param) for m in stages or modules()), strict=True)
    params = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), params)  # on this device

    def mean_loss(ps):
        h = nnx.merge(graphs[0], ps[0])(tokens, *extra)
        h = h if isinstance(h, tuple) else (h,)
        per = optax.softmax_cross_entropy_with_integer_labels(nnx.merge(graphs[1], ps[1])(*h),
                                                              labels)
        per = per.reshape(M, -1).mean(axis=1)
        return per.mean(), per

    (_, per), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
    after = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    return np.asarray(per), grads, after


def full(tree):
    return jax.tree.map(lambda a: np.asarray(jax.device_get(a)), nnx.to_pure_dict(tree))


def close(got, want):
    for a, b in zip(jax.tree.leaves(full(got)), jax.tree.leaves(full(want)), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6 * max(1.0, float(np.abs(b).max())))


def run_pipeline(stages, tokens, labels, split):
    """One step of both stages' programs over ``M`` microbatches (all forwards, then the
    backwards; ``split``: each backward as ZB's input and weight halves), as a schedule's
    step runs them. ``tokens``: the first stage's input, or a tuple of its inputs."""
    progs = [stage_programs(st, ce) for st in stages]
    params = [st.program_params() for st in stages]
    rests = [st.placed(st.frozen_state()) for st in stages]
    rows = B // M
    losses, grads, keep = [], [None, None], []
    inputs = tokens if isinstance(tokens, tuple) else (tokens,)  # the first stage's inputs

    def to(s, tree):  # what the lanes do: a one-device stage's inputs onto its device
        return tree if stages[s].layout is not None else jax.device_put(tree, stages[s].device)

    for mb in range(M):
        x = tuple(a[mb * rows:(mb + 1) * rows] for a in inputs)
        t = labels[mb * rows:(mb + 1) * rows]
        h, vjp0 = progs[0].forward(params[0], rests[0], to(0, x))
        loss, _, vjp1 = progs[1].forward_loss(params[1], rests[1], to(1, h), to(1, t))
        losses.append(float(loss))
        keep.append((vjp0, vjp1, loss))
    for vjp0, vjp1, loss in keep:
        one = jnp.ones((), loss.dtype)
        if split:
            dh = progs[1].backward_input(vjp1, one)
            grads[1] = progs[1].weight(vjp1, one, grads[1])
            grads[0] = progs[0].weight(vjp0, to(0, dh), grads[0])
        else:
            dh, grads[1] = progs[1].backward(vjp1, one, grads[1])
            _, grads[0] = progs[0].backward(vjp0, to(0, dh), grads[0])
    grads = [st.finish_grads(g) for st, g in zip(stages, grads, strict=True)]
    return np.array(losses), [jax.tree.map(lambda g: g / M, g) for g in grads], keep


def check_step(stages, losses, grads, want_losses, want_grads):
    """A step's losses and gradients against the reference's, each gradient in its
    parameter's layout."""
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6, atol=1e-6)
    for s, st in enumerate(stages):
        close(grads[s], want_grads[s])
        placed = jax.tree.leaves(st.placed(st.params()))
        for g, p in zip(jax.tree.leaves(grads[s]), placed, strict=True):
            assert g.sharding.is_equivalent_to(p.sharding, p.ndim), (g.sharding, p.sharding)


def check_sgd(stages, grads, want_after):
    """An optax SGD step over each stage's gradients, in their layout, gives the reference's
    parameters."""
    tx = optax.sgd(0.1)
    for s, st in enumerate(stages):
        params = st.placed(st.params())
        updates, _ = tx.update(grads[s], tx.init(params), params)
        nnx.update(st.submod, optax.apply_updates(params, updates))
        close(st.params(), want_after[s])


@pytest.mark.parametrize(("split", "reshard"), [(False, True), (True, True), (False, False)],
                         ids=["whole", "split", "gathered_once_a_step"])
def test_fully_sharded_stages_give_the_un_pipelined_gradients(world, split, reshard):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, V, (B, 4)), jnp.int32)
    labels = jnp.asarray(rng.integers(0, V, (B, 4)), jnp.int32)
    want_losses, want_grads, want_after = reference(tokens, labels)

    mesh = jaxpg.init_device_mesh((2, 4), ("pp", "dp_shard"))
    stages = []
    for s, module in enumerate(modules()):
        with jaxpg.as_rank(4 * s):  # stage s's dp_shard group: devices 4s .. 4s + 3
            stages.append(PipelineStage(module, s, 2, group=mesh["pp"],
                                        fsdp_group=mesh["dp_shard"],
                                        reshard_after_forward=reshard))
    for s, st in enumerate(stages):
        assert [d.id for d in st.fsdp.mesh.devices.flat] == [4 * s + i for i in range(4)]
        specs = {str(k): a.sharding.spec for k, a in nnx.to_flat_state(st.params())}
        assert set(specs.values()) == ({P("dp_shard"), P()} if s == 0 else {P("dp_shard")})

    # the programs take the shards, or the parameters gathered once for the step
    assert {a.sharding.spec for st in stages for a in jax.tree.leaves(st.program_params())
            if a.ndim} == ({P("dp_shard")} if reshard else {P()})
    losses, grads, keep = run_pipeline(stages, tokens, labels, split)
    check_step(stages, losses, grads, want_losses, want_grads)
    # the forward kept no gathered parameter for the backward (reshard_after_forward)
    whole = {tuple(a.shape) for st in stages for a in jax.tree.leaves(st.params()) if a.ndim}
    for vjp0, vjp1, _ in keep if reshard else ():
        for vjp in (vjp0, vjp1):
            kept = {tuple(r.shape[1:]) for r in vjp.residuals}
            assert not kept & whole, kept & whole

    # an SGD step over the shards gives the reference's parameters
    check_sgd(stages, grads, want_after)
    assert all(a.sharding.spec == P("dp_shard")
               for st in stages for a in jax.tree.leaves(st.params()) if a.ndim)


def test_fully_sharded_stage_names_what_does_not_split(world):
    mesh = jaxpg.init_device_mesh((2, 4), ("pp", "dp_shard"))

    class Odd(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(6, 4, rngs=nnx.Rngs(0))  # kernel [6, 4]: 4 does not divide 6

        def __call__(self, x):
            return self.lin(x)

    with pytest.raises(ValueError, match=r"parameter 'lin.kernel' of shape \(6, 4\) has a "
                                         r"leading dimension 6 that the dp_shard group's size 4"):
        PipelineStage(Odd(), 0, 2, group=mesh["pp"], fsdp_group=mesh["dp_shard"])
    with pytest.raises(ValueError, match=r"shares ranks \[0, 4\] with the pipeline group"):
        PipelineStage(NormHead(nnx.Rngs(0)), 0, 2, group=mesh["pp"], fsdp_group=mesh["pp"])
    with pytest.raises(ValueError, match="with data_parallel_group= is not offered"):
        dp = jaxpg.init_device_mesh((2, 2, 2), ("dp", "pp", "dp_shard"))
        PipelineStage(NormHead(nnx.Rngs(0)), 0, 2, group=dp["pp"],
                      data_parallel_group=dp["dp"], fsdp_group=dp["dp_shard"])
    with pytest.raises(ValueError, match="reshard_after_forward=False needs fsdp_group="):
        PipelineStage(NormHead(nnx.Rngs(0)), 0, 2, group=mesh["pp"],
                      reshard_after_forward=False)
    stage = PipelineStage(NormHead(nnx.Rngs(0)), 1, 2, group=mesh["pp"],
                          fsdp_group=mesh["dp_shard"])
    progs = stage_programs(stage, ce)
    with pytest.raises(ValueError, match=r"a microbatch of 6 rows .* does not split over this "
                                         r"process's 4 devices .* a multiple of 4 rows"):
        progs.forward_loss(stage.placed(stage.params()), stage.placed(stage.frozen_state()),
                           (jnp.zeros((6, 4, D)),), jnp.zeros((6, 4), jnp.int32))
