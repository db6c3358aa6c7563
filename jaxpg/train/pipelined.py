"""The recipe's pipelined path: a ``jaxpg.models`` model trained by the pipeline executor.

The model's decoder layers are all alike, so they run as the repeated block of
:func:`jaxpg.pipeline.pipeline_value_and_grad`: the layers' states are stacked by stage
(``num_layers / (pp * chunks)`` layers each, in model order), the embedding is the first
stage's ``first_fn``, and the final norm, the head and the cross-entropy are the last
stage's loss. Each stage computes its RoPE tables from the global positions
``arange(seq_len)`` (a pipeline stage holds whole sequences). The parameters are a
:class:`~jaxpg.pipeline.StagedParams` of plain pytrees, placed by
:func:`jaxpg.pipeline.init_train_state` on ``ParallelDims(dp_replicate=..., pp=...)``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpg.models.rope import inverse_frequencies, rope_tables
from jaxpg.pipeline import StagedParams, get_schedule, init_train_state, pipeline_value_and_grad

__all__ = ["chunks_of", "PipelinedLM"]

_TWO_CHUNKS = ("interleaved_1f1b", "zb_v", "dualpipe_v")


def chunks_of(schedule: str, chunks: int) -> int:
    """Model chunks per pipeline rank: ``chunks``, or the schedule's own for 0."""
    if chunks:
        return chunks
    return 2 if schedule in _TWO_CHUNKS else 1


def _token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets).mean()


class PipelinedLM:
    """A ``CausalLM`` cut into pipeline stages, with its jitted train step and eval loss.

    Args:
        model: the ``CausalLM`` (its weights are the initial ones; it is not changed).
        optimizer: the optax optimizer.
        dims: a ``ParallelDims`` with ``pp`` and ``dp_replicate``.
        schedule: a :func:`jaxpg.pipeline.get_schedule` name.
        microbatches: microbatches per replica and step.
        chunks: model chunks per pipeline rank.

    Raises:
        ValueError: a mixture-of-experts model, tied embeddings, or ``num_layers`` not a
            multiple of ``pp * chunks``; each names the fix.
    """

    def __init__(self, model: Any, optimizer: optax.GradientTransformation, dims: Any, *,
                 schedule: str, microbatches: int, chunks: int):
        config = model.config
        pp = dims.pp
        stages = pp * chunks
        if getattr(config, "num_experts", 0):
            raise ValueError(f"jaxpg.train: layout.pp={pp} with {type(config).__name__}: the "
                             "pipelined recipe takes the dense families (Llama 3, Qwen 3); "
                             "set pp = 1 to train the mixture of experts.")
        if config.tie_word_embeddings:
            raise ValueError(f"jaxpg.train: layout.pp={pp}: the model ties its head to the "
                             "embedding, which the first and last stages would share; set "
                             "tie_word_embeddings = false in [model.overrides] (or pp = 1).")
        if config.num_layers % stages:
            raise ValueError(f"jaxpg.train: num_layers={config.num_layers} is not a multiple "
                             f"of pp x chunks = {pp} x {chunks} = {stages} stages; choose a pp "
                             "(or chunks) that divides it, or set num_layers in "
                             "[model.overrides].")
        get_schedule(schedule, pp, microbatches, chunks)  # refuses what does not fit, by name
        self.config, self.dims, self.optimizer = config, dims, optimizer
        self.schedule, self.microbatches = schedule, microbatches
        self.per_stage = config.num_layers // stages
        layer_splits = [nnx.split(layer) for layer in model.layers]
        self.layer_def = layer_splits[0][0]
        k = self.per_stage
        stacked = jax.tree.map(
            lambda *xs: jnp.stack(xs).reshape(stages, k, *jnp.shape(xs[0])),
            *[state for _, state in layer_splits])
        self.embed_def, embed = nnx.split(model.embed_tokens)
        self.norm_def, norm = nnx.split(model.norm)
        self.head_def, head = nnx.split(model.lm_head)
        params = StagedParams(stacked, embed, {"norm": norm, "lm_head": head})
        self.params, self.opt_state = init_train_state(params, optimizer, dims)
        self._step = jax.jit(self._train_step, donate_argnums=(0, 1))
        self._eval = jax.jit(self._eval_loss)

    # the pipeline's three functions
    def _stage(self, state: Any, x: jax.Array) -> jax.Array:
        positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
        cos, sin = rope_tables(positions, inverse_frequencies(self.config))
        for i in range(self.per_stage):
            layer = nnx.merge(self.layer_def, jax.tree.map(lambda a, i=i: a[i], state))
            x = layer(x, cos, sin)
        return x

    def _embed(self, state: Any, tokens: jax.Array) -> jax.Array:
        return nnx.merge(self.embed_def, state)(tokens)

    def _head_loss(self, last: Any, y: jax.Array, targets: jax.Array) -> jax.Array:
        h = nnx.merge(self.norm_def, last["norm"])(y)
        return _token_loss(nnx.merge(self.head_def, last["lm_head"])(h), targets)

    def _train_step(self, params: Any, opt_state: Any, tokens: jax.Array,
                    targets: jax.Array) -> tuple[Any, Any, jax.Array, jax.Array]:
        loss, grads = pipeline_value_and_grad(
            self._stage, self._head_loss, params, tokens, targets, mesh=self.dims,
            schedule=self.schedule, num_microbatches=self.microbatches,
            first_fn=self._embed, executor="spmd")
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    def _eval_loss(self, params: Any, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        x = self._embed(params.first, tokens)
        for s in range(jax.tree.leaves(params.stages)[0].shape[0]):
            x = self._stage(jax.tree.map(lambda a, s=s: a[s], params.stages), x)
        return self._head_loss(params.last, x, targets)

    def train_step(self, batch: dict[str, Any]) -> tuple[float, float]:
        """One optimizer step on a global batch; ``(loss, grad_norm)``."""
        self.params, self.opt_state, loss, norm = self._step(
            self.params, self.opt_state, batch["tokens"], batch["targets"])
        return float(loss), float(norm)

    def eval_loss(self, batch: dict[str, Any]) -> float:
        """The mean loss of a global batch under the current parameters (no pipeline)."""
        return float(self._eval(self.params, batch["tokens"], batch["targets"]))

    def state(self) -> dict[str, Any]:
        """``{"params", "opt_state"}``: the training state a checkpoint holds."""
        return {"params": self.params, "opt_state": self.opt_state}

    def load_state(self, state: dict[str, Any]) -> None:
        """Sets the training state from :meth:`state`'s structure."""
        self.params, self.opt_state = state["params"], state["opt_state"]
