"""A model's pipeline stages (``jaxpg.models.pipeline_stages``) as PipelineStages, in one
process: a Qwen3-MoE model cut into two stages, each on its own device (pp = 2), the
position ids carried from the first stage to the second beside the activations; their
programs (the ones a schedule runs) driven microbatch by microbatch.

Losses, gradients and an SGD step must equal the un-pipelined model's on the whole batch.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx
from test_stage_fsdp import B, check_sgd, check_step, reference, run_pipeline

import jaxpg
from jaxpg import models
from jaxpg.pipeline import PipelineStage

S = 8  # the sequence


def test_model_stages_carry_positions_and_give_the_model_s_gradients(world):
    config = models.config_for("qwen3-moe-tiny")
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (B, S)), jnp.int32)
    labels = jnp.asarray(rng.integers(0, config.vocab_size, (B, S)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), tokens.shape)
    want_losses, want_grads, want_after = reference(
        tokens, labels, models.pipeline_stages(models.CausalLM(config, rngs=nnx.Rngs(0)), 2),
        (positions,))

    mesh = jaxpg.init_device_mesh((2, 4), ("pp", "dp"))
    parts = models.pipeline_stages(models.CausalLM(config, rngs=nnx.Rngs(0)), 2)
    stages = []
    for s, part in enumerate(parts):
        with jaxpg.as_rank(4 * s):  # stage s on device 4s
            stages.append(PipelineStage(part, s, 2, group=mesh["pp"]))
    assert [st.device.id for st in stages] == [0, 4]
    losses, grads, _ = run_pipeline(stages, (tokens, positions), labels, False)
    check_step(stages, losses, grads, want_losses, want_grads)
    check_sgd(stages, grads, want_after)
