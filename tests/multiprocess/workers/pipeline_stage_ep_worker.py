"""PipelineStage with expert-parallel stages, run by pipeline_stage_worker.py with 4
processes: a ("pp", "ep") = (2, 2) mesh, two unequal stages (an embedding and an MoE block |
an MoE block, a norm and a head: test_stage_ep.py's), each holding an ``MoELayer`` over
``mesh["ep"]`` (8 experts, 4 a process) and passed ``expert_parallel_group=mesh["ep"]``, each
ep process feeding its own half of the batch; and by pipeline_stage8_worker.py with 8: a
(4, 2) mesh, the two MoE blocks between them as the middle stages, 4 microbatches.

A ``Schedule1F1B`` step, an optax SGD step over ``stage.grads``, then a ``ScheduleGPipe``
step: the last stage's microbatch losses, every stage's gradients (the experts' gathered
from their ep shards, which keep the parameters' layout) and the parameters after the SGD
step must equal the un-pipelined model's with every expert on one device (ep = 1, the same
seeds) on the whole batch (one jitted program, on rank 0). Prints ``EP <name> ok`` (a
failure raises, failing the launch).
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from pipeline_stage_tp_worker import M, reference, split_order, two_steps

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "pipeline"))
from test_stage_ep import D, E, EmbedMoE, H, MoEHead, V  # noqa: E402 (the in-process test's)

import jaxpg  # noqa: E402
from jaxpg.expert_parallel import MoELayer  # noqa: E402
from jaxpg.pipeline import PipelineStage  # noqa: E402


def _verify(name: str, cond: bool) -> None:
    """Raises unless ``cond`` (failing the launch); prints ``EP <name> ok``."""
    if not cond:
        raise AssertionError(f"EP {name} failed on process {jax.process_index()}")
    print(f"EP {name} ok", flush=True)


def ce(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class MoEBlock(nnx.Module):
    """A middle stage: a pre-norm residual MoE layer (GeLU experts)."""

    def __init__(self, group, rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.moe = MoELayer(D, H, E, top_k=2, group=group, rngs=rngs)

    def __call__(self, h):
        return h + self.moe(self.norm(h))


def modules(group, pp: int = 2) -> list[nnx.Module]:
    """``pp`` unequal stages: an embedding and an MoE layer, ``pp - 2`` MoE blocks, an MoE
    layer, a norm and a head (test_stage_ep.py's first and last, their seeds)."""
    middle = [MoEBlock(group, nnx.Rngs(10 + s)) for s in range(1, pp - 1)]
    return [EmbedMoE(group, nnx.Rngs(3)), *middle, MoEHead(group, nnx.Rngs(4))]


def run_expert_parallel(rng: np.random.Generator, pp: int = 2, ep: int = 2,
                        m: int = M) -> None:
    """EP stages: ``pp`` x ``ep``, each process its ``ep``-th of the batch, ``m``
    microbatches."""
    one, _ = jaxpg.new_subgroups(group_size=1)  # every process: the reference's ep = 1
    mesh = jaxpg.init_device_mesh((pp, ep), ("pp", "ep"))
    s, d = mesh.get_local_rank("pp"), mesh.get_local_rank("ep")
    tokens = rng.integers(0, V, (4 * ep * m // 2, 6)).astype(np.int32)
    labels = rng.integers(0, V, tokens.shape).astype(np.int32)
    part = len(tokens) // ep
    mine = slice(d * part, (d + 1) * part)
    # microbatch i of the step is every part's i-th microbatch: the reference's batch in
    # that order has them as its i-th m-th
    order = split_order(len(tokens), ep, m)
    ref = reference(jnp.asarray(tokens[order]), jnp.asarray(labels[order]),
                    modules(one, pp), m=m) if jaxpg.get_rank() == 0 else (None, None)
    ref = jaxpg.broadcast_object_list(list(ref), src=0)
    stage = PipelineStage(modules(mesh["ep"], pp)[s], s, pp, group=mesh["pp"],
                          expert_parallel_group=mesh["ep"])

    def experts_split(state):  # the experts split over ep on the stage's mesh, the rest not
        split, whole = (NamedSharding(stage.ep.mesh, spec) for spec in (P("ep"), P()))
        return all(a.sharding.is_equivalent_to(split if k[-1] in ("w1", "w2") else whole,
                                               a.ndim)
                   for k, a in nnx.to_flat_state(state))

    _verify("experts_split", experts_split(stage.params()))
    two_steps(stage, (jnp.asarray(tokens[mine]),), jnp.asarray(labels[mine]), ref, ce,
              _verify, experts_split, m=m)
