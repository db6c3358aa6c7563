"""The families' tensor-parallel plans (torch's ``parallelize_module`` styles), kv-heads aware.

Megatron's split of a decoder layer: ``q_proj``, ``k_proj``, ``v_proj`` and the MLP's
``gate_proj``/``up_proj`` column-parallel (each tp rank holds whole query heads *and*
whole key/value heads, so its queries find their keys locally), ``o_proj`` and
``down_proj`` row-parallel; the embedding split on the vocabulary and the head on it too.
Qwen 3's per-head q/k norms are replicated and see only the rank's heads, so their
gradients are summed over tp (``SequenceParallel``'s rule for replicated weights). With
``sequence_parallel`` the norms and the residual stream are split along the sequence
between the projections (all-gathered before the column-parallel ones, reduce-scattered
after the row-parallel ones). Experts are not split over tp: they are expert-parallel.
"""

from __future__ import annotations

from jaxpg.models.config import ModelConfig
from jaxpg.tensor_parallel import (
    ColwiseParallel,
    ParallelStyle,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
)

__all__ = ["tp_plan", "check_tp_degree"]


def check_tp_degree(config: ModelConfig, tp: int) -> None:
    """Raises a ValueError naming the fix when ``tp`` cannot split ``config``'s heads."""
    if tp == 1:
        return
    if config.num_kv_heads % tp:
        fits = [n for n in range(1, config.num_kv_heads + 1) if config.num_kv_heads % n == 0]
        raise ValueError(
            f"tp={tp} does not divide num_kv_heads={config.num_kv_heads}: each tensor-parallel "
            "rank holds whole key/value heads (with the query heads that use them); choose "
            f"tp among {fits}.")
    for name in ("num_heads", "vocab_size", "intermediate_size"):
        size = getattr(config, name)
        if size % tp:
            raise ValueError(f"tp={tp} does not divide {name}={size}; choose a tensor-parallel "
                             f"degree that divides it.")


def tp_plan(config: ModelConfig, *, sequence_parallel: bool = False
            ) -> dict[str, ParallelStyle]:
    """The plan for :func:`jaxpg.tensor_parallel.parallelize_module` of a ``CausalLM``.

    Args:
        config: the model's config.
        sequence_parallel: also split the norms and the residual stream along the sequence
            (Megatron's sequence parallelism; dense models only).

    Returns:
        ``{module path: style}``, one entry per submodule (layer indices explicit, since
        MoE layers have no MLP projections).

    Raises:
        ValueError: ``sequence_parallel`` for a model with experts.
    """
    sp = bool(sequence_parallel)
    moe_layers = [i for i in range(config.num_layers) if config.is_moe_layer(i)]
    if sp and moe_layers:
        raise ValueError("tp_plan: sequence_parallel=True is for dense models; the experts of "
                         f"layers {moe_layers} take whole sequences. Pass "
                         "sequence_parallel=False.")
    seq = Shard(1)
    col = ColwiseParallel(input_layouts=seq) if sp else ColwiseParallel()
    row = RowwiseParallel(output_layouts=seq) if sp else RowwiseParallel()
    plan: dict[str, ParallelStyle] = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                        output_layouts=seq if sp else Replicate()),
    }
    for i in range(config.num_layers):
        base = f"layers.{i}"
        if sp:
            plan[f"{base}.input_layernorm"] = SequenceParallel()
            plan[f"{base}.post_attention_layernorm"] = SequenceParallel()
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{base}.self_attn.{name}"] = col
        plan[f"{base}.self_attn.o_proj"] = row
        if config.qk_norm:  # replicated weights on this rank's heads: gradients summed
            plan[f"{base}.self_attn.q_norm"] = SequenceParallel(sequence_dim=2)
            plan[f"{base}.self_attn.k_norm"] = SequenceParallel(sequence_dim=2)
        if not config.is_moe_layer(i):
            plan[f"{base}.mlp.gate_proj"] = col
            plan[f"{base}.mlp.up_proj"] = col
            plan[f"{base}.mlp.down_proj"] = row
    if sp:
        plan["norm"] = SequenceParallel()
    if not config.tie_word_embeddings:
        plan["lm_head"] = ColwiseParallel(input_layouts=seq if sp else Replicate(),
                                          output_layouts=Replicate())
    return plan
