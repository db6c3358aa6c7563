"""Activation memory of one transformer block, after Korthikanti et al. (2022).

"Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198) counts the
bytes one block saves for its backward, for ``s`` tokens of ``b`` sequences, width ``h``,
``a`` heads and ``t``-way tensor parallelism (16-bit activations, 1-byte dropout masks)::

    no parallelism                  s b h (34 + 5 a s / h)
    tensor parallel                 s b h (10 + 24 / t + 5 a s / (h t))
    tensor + sequence parallel      s b h (34 / t + 5 a s / (h t))
    ... with selective recompute    s b h (34 / t)          (attention's core recomputed)
    full recompute                  2 s b h  (/ t with sequence parallelism)

:func:`block_activation_bytes` computes the same terms from a :class:`TransformerSpec`, so
they also hold for grouped-query attention (k and v are ``kv_dim`` wide), SwiGLU (three
``ffn``-wide tensors instead of GeLU's two), no dropout, fused attention (no ``s x s`` scores:
the output and its row statistics instead) and routed experts (each token's ``top_k`` copies).
For a GPT block it reproduces the formulas above exactly (``tests/plan``).
"""

from __future__ import annotations

__all__ = ["attention_core_bytes", "block_activation_bytes", "block_parts"]


def attention_core_bytes(spec, *, tokens: float, seq_len: int, tp: int, act: int) -> float:
    """Saved bytes of the attention core (scores, softmax, dropout) on one device.

    ``tokens`` are the device's query tokens (``b s / cp``); each attends to ``seq_len`` keys.
    """
    heads = spec.heads / tp
    if spec.flash_attention:
        return tokens * heads * 4.0  # fp32 log-sum-exp per row (the output is counted apart)
    scores = tokens * heads * seq_len
    if spec.dropout:
        return scores * (act + act + 1)  # softmax output, dropout output, dropout mask
    return scores * act  # the softmax output


def block_parts(spec, *, moe: bool, tokens: float, seq_len: int, tp: int, act: int,
                expert_rows: float | None = None,
                fused_experts: bool = False) -> tuple[float, float, float]:
    """One block's saved bytes as (outside tp, inside tp, attention core), per device.

    ``expert_rows``: the rows an MoE block's experts run on (a dispatch buffer's, padded
    past the routed ones); None: the routed ``tokens · top_k``. ``fused_experts``: the
    experts' MLP is one loop that keeps only its pre-activations (one ``expert_ffn``-wide
    tensor fewer than the two matmuls keep: not the activation's output).

    "Outside" are the tensors tensor parallelism leaves whole (norm inputs, the inputs of the
    column-parallel matmuls, dropout masks after the row-parallel ones): sequence parallelism
    splits them over tp. "Inside" are already split over tp. The core is attention's
    ``s x s`` part, which selective recomputation drops.
    """
    h, mask = spec.dim, (1 if spec.dropout else 0)
    outside = tokens * h * (4 * act + 2 * mask)          # 2 norm inputs, 2 matmul inputs, masks
    inside = tokens * (act * (spec.q_dim + 2 * spec.kv_dim)    # q, k, v
                       + act * spec.q_dim)                      # the output projection's input
    if spec.flash_attention:
        inside += tokens * act * spec.q_dim                     # attention's output, kept
    inside /= tp
    per_ffn = 3 if spec.mlp == "swiglu" else 2                  # gate, up, product | in, out
    if moe:
        routed = tokens * spec.top_k
        rows = routed if expert_rows is None else expert_rows
        kept = per_ffn - 1 if fused_experts else per_ffn
        inside_mlp = (rows * kept + tokens * spec.shared_experts * per_ffn) * act \
            * spec.expert_ffn / tp
        # the experts' inputs, the routed outputs the combine weighs, the router's scores
        inside_mlp += (rows + routed) * act * h / tp + tokens * spec.experts * 4 / tp
    else:
        inside_mlp = tokens * per_ffn * act * spec.ffn / tp
    core = attention_core_bytes(spec, tokens=tokens, seq_len=seq_len, tp=tp, act=act)
    return outside, inside + inside_mlp, core


def block_activation_bytes(spec, *, moe: bool, tokens: float, seq_len: int, tp: int,
                           sp: bool, remat: str, act: int = 2,
                           expert_rows: float | None = None,
                           fused_experts: bool = False) -> float:
    """The bytes one block saves for its backward on one device.

    Args:
        spec: the :class:`~jaxpg.plan.TransformerSpec`.
        moe: whether the block's MLP is the mixture of experts.
        tokens: the device's tokens in the microbatch (``b s / cp``).
        seq_len: the full sequence (attention's key length).
        tp: tensor-parallel degree.
        sp: sequence parallelism (splits the "outside" tensors over tp).
        remat: ``"none"``, ``"selective"`` or ``"full"``.
        act: bytes per activation element.
        expert_rows: the rows an MoE block's experts run on (see :func:`block_parts`).
        fused_experts: their MLP is one tiled loop (see :func:`block_parts`).
    """
    outside, inside, core = block_parts(spec, moe=moe, tokens=tokens, seq_len=seq_len, tp=tp,
                                        act=act, expert_rows=expert_rows,
                                        fused_experts=fused_experts)
    if sp:
        outside /= tp
    if remat == "full":
        return tokens * spec.dim * act / (tp if sp else 1)
    if remat == "selective":
        return outside + inside
    return outside + inside + core
