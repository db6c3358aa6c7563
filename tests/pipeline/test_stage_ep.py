"""Expert-parallel PipelineStages in one process, on the 8 simulated devices: a
``("pp", "ep") = (2, 4)`` mesh, two unequal stages each holding an ``MoELayer`` over its
4 ep devices (8 experts, 2 a device), their programs (the ones a schedule runs) driven
microbatch by microbatch by hand, each ep rank routing its own rows.

Losses, gradients and an SGD step must equal the un-pipelined model's with every expert on
one device (ep = 1, the same seeds) on the whole batch; the experts and their gradients
must stay split over ep and the other parameters replicated, also with a dense first stage
(no experts: every parameter replicated). (Schedules across processes run the same
programs: tests/multiprocess/workers/pipeline_stage_ep_worker.py.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_stage_fsdp import B, check_sgd, check_step, reference, run_pipeline

import jaxpg
from jaxpg.expert_parallel import MoELayer
from jaxpg.pipeline import PipelineStage

V, D, H, E = 12, 8, 16, 8  # vocabulary, width, each expert's hidden width, experts


class EmbedMoE(nnx.Module):
    def __init__(self, group, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.moe = MoELayer(D, H, E, top_k=2, group=group, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        return h + self.moe(self.norm(h))


class EmbedMLP(nnx.Module):
    """A dense first stage (no experts): every parameter replicated over ep."""

    def __init__(self, group, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.fc = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        return h + jax.nn.gelu(self.fc(h))


class MoEHead(nnx.Module):
    def __init__(self, group, rngs):
        self.moe = MoELayer(D, H, E, top_k=2, group=group, rngs=rngs,
                            activation=jax.nn.silu)
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.out = nnx.Linear(D, V, use_bias=False, rngs=rngs)

    def __call__(self, h):
        return self.out(self.norm(h + self.moe(h)))


def modules(group, dense_first=False):
    first = EmbedMLP if dense_first else EmbedMoE
    return first(group, nnx.Rngs(3)), MoEHead(group, nnx.Rngs(4))


def _stages(mesh, dense_first):
    stages = []
    for s in range(2):
        with jaxpg.as_rank(4 * s):  # stage s's ep group: devices 4s .. 4s + 3
            module = modules(mesh["ep"], dense_first)[s]
            stages.append(PipelineStage(module, s, 2, group=mesh["pp"],
                                        expert_parallel_group=mesh["ep"]))
    return stages


@pytest.mark.parametrize(("split", "dense_first"), [(False, False), (True, False),
                                                    (False, True)],
                         ids=["whole", "split", "dense_first_stage"])
def test_expert_parallel_stages_give_the_un_pipelined_gradients(world, split, dense_first):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, V, (B, 4)), jnp.int32)
    labels = jnp.asarray(rng.integers(0, V, (B, 4)), jnp.int32)
    one, _ = jaxpg.new_subgroups(group_size=1)  # the reference: every expert on one device
    want_losses, want_grads, want_after = reference(tokens, labels, modules(one, dense_first))

    mesh = jaxpg.init_device_mesh((2, 4), ("pp", "ep"))
    stages = _stages(mesh, dense_first)
    experts = P("ep", None, None)
    for s, st in enumerate(stages):
        assert [d.id for d in st.ep.mesh.devices.flat] == [4 * s + i for i in range(4)]
        specs = {str(k): a.sharding.spec for k, a in nnx.to_flat_state(st.params())}
        assert {k for k, v in specs.items() if v == experts} == (
            set() if dense_first and s == 0 else {"('moe', 'w1')", "('moe', 'w2')"}), specs
        assert {v for v in specs.values() if v != experts} == {P()}, specs

    losses, grads, _ = run_pipeline(stages, tokens, labels, split)
    check_step(stages, losses, grads, want_losses, want_grads)
    check_sgd(stages, grads, want_after)  # an SGD step gives the reference's parameters


def test_expert_parallel_stage_names_what_it_cannot_run(world):
    mesh = jaxpg.init_device_mesh((2, 4), ("pp", "ep"))
    with pytest.raises(ValueError, match=r"shares ranks \[0, 4\] with the pipeline group"):
        PipelineStage(MoEHead(mesh["ep"], nnx.Rngs(0)), 0, 2, group=mesh["pp"],
                      expert_parallel_group=mesh["pp"])
    with pytest.raises(ValueError, match="with fsdp_group= is not offered"):
        PipelineStage(MoEHead(mesh["ep"], nnx.Rngs(0)), 0, 2, group=mesh["pp"],
                      expert_parallel_group=mesh["ep"], fsdp_group=mesh["ep"])
    other = jaxpg.init_device_mesh((2, 4), ("pp", "experts"))
    with pytest.raises(ValueError, match=r"array 'moe\.\w+' is laid out as .* not on the group's "
                                         r"mesh .* build the stage's MoELayers with group="):
        PipelineStage(MoEHead(other["experts"], nnx.Rngs(0)), 0, 2, group=mesh["pp"],
                      expert_parallel_group=mesh["ep"])
