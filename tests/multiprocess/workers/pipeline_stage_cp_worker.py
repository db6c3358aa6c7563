"""PipelineStage with context-parallel stages, run by pipeline_stage_worker.py with 4
processes: a ("pp", "cp") = (2, 2) mesh, two unequal stages of causal self-attention
through ``ContextParallelAttention`` over ``mesh["cp"]`` (ring attention, the load-balanced
layout; test_stage_cp.py's modules), passed ``context_parallel_group=mesh["cp"]``: each cp
process feeds its part of every sequence and its position ids, which the first stage
carries to the second beside the activations.

A ``Schedule1F1B`` step, an optax SGD step over ``stage.grads``, then a ``ScheduleGPipe``
step: the last stage's microbatch losses, every stage's gradients and the parameters after
the SGD step must equal the un-pipelined model's with plain attention over each whole
sequence (one jitted program, on rank 0). Prints ``CP <name> ok`` (a failure raises,
failing the launch).
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P
from pipeline_stage_tp_worker import reference, two_steps

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "pipeline"))
from test_stage_cp import S, V, modules  # noqa: E402 (the in-process test's stages)

import jaxpg  # noqa: E402
from jaxpg.context_parallel import shard_sequence  # noqa: E402
from jaxpg.pipeline import PipelineStage  # noqa: E402


def _verify(name: str, cond: bool) -> None:
    """Raises unless ``cond`` (failing the launch); prints ``CP <name> ok``."""
    if not cond:
        raise AssertionError(f"CP {name} failed on process {jax.process_index()}")
    print(f"CP {name} ok", flush=True)


def ce(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def run_context_parallel(rng: np.random.Generator, cp: int = 2) -> None:
    """CP stages: pp = 2 x ``cp``, each process its part of every sequence."""
    mesh = jaxpg.init_device_mesh((2, cp), ("pp", "cp"))
    s = mesh.get_local_rank("pp")
    tokens = rng.integers(0, V, (4, S)).astype(np.int32)
    labels = rng.integers(0, V, (4, S)).astype(np.int32)
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), tokens.shape)
    ref = reference(jnp.asarray(tokens), jnp.asarray(labels), list(modules(False)),
                    (positions,)) if jaxpg.get_rank() == 0 else (None, None)
    ref = jaxpg.broadcast_object_list(list(ref), src=0)
    # this process's part of every sequence, and its tokens' positions
    mine = shard_sequence(tokens, mesh["cp"], load_balance=True)
    my_labels = shard_sequence(labels, mesh["cp"], load_balance=True).x
    stage = PipelineStage(modules(mesh["cp"])[s], s, 2, group=mesh["pp"],
                          context_parallel_group=mesh["cp"])

    def replicated(state):
        return {a.sharding.spec for a in jax.tree.leaves(state)} == {P()}

    _verify("params_replicated", replicated(stage.params()))
    two_steps(stage, (mine.x, jnp.broadcast_to(mine.position_ids, mine.x.shape)), my_labels,
              ref, ce, _verify, replicated)
