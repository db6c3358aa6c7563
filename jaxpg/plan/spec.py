"""A transformer described by its sizes: parameter counts and FLOPs per token.

A :class:`TransformerSpec` is what the planner needs of a decoder-only transformer: layers,
widths, heads (with grouped-query kv heads), the MLP's kind (SwiGLU's three matrices or GPT's
two with GeLU) and, for a mixture of experts, the experts, how many each token visits and
their width. Presets by name are in :mod:`jaxpg.plan.presets`.

FLOPs follow the papers' convention (Narayanan et al. 2021, eq. 3): a matmul of ``n``
parameters costs ``2 n`` FLOPs per token forward, the backward twice that, and attention's
two ``s x s`` products cost ``4 s q`` per token per layer (``q = heads x head_dim``), counted
in full as Megatron-LM does.

Example:
    >>> spec = TransformerSpec(layers=2, dim=64, heads=4, ffn=256, vocab=1000)
    >>> spec.params
    259392
"""

from __future__ import annotations

import dataclasses
import functools

__all__ = ["TransformerSpec"]

MLP_KINDS = ("swiglu", "gelu")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerSpec:
    """The sizes of a decoder-only transformer.

    Args:
        layers: transformer blocks.
        dim: the model (residual) width.
        heads: query heads.
        ffn: the dense MLP's inner width.
        vocab: vocabulary size.
        kv_heads: key/value heads (grouped-query attention); None for ``heads``.
        head_dim: width of one head; None for ``dim // heads``.
        mlp: ``"swiglu"`` (three matrices, Llama's) or ``"gelu"`` (two, GPT's).
        experts: routed experts per MoE layer; 0 for a dense model.
        top_k: experts each token visits.
        expert_ffn: one expert's inner width (SwiGLU).
        shared_experts: experts every token visits, besides the routed ones.
        dense_layers: leading blocks with a dense MLP in an MoE model (DeepSeek-V3's first 3).
        tied_embeddings: whether the output head reuses the embedding.
        dropout: whether the blocks apply dropout (its masks are saved for the backward).
        flash_attention: whether attention runs fused (no ``s x s`` scores kept in memory).
        name: a label for tables.
    """

    layers: int
    dim: int
    heads: int
    ffn: int
    vocab: int
    kv_heads: int | None = None
    head_dim: int | None = None
    mlp: str = "swiglu"
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    tied_embeddings: bool = False
    dropout: bool = False
    flash_attention: bool = True
    name: str = "custom"

    def __post_init__(self) -> None:
        for field in ("layers", "dim", "heads", "ffn", "vocab"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TransformerSpec: {field}={value!r} must be an int >= 1.")
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.head_dim is None:
            if self.dim % self.heads:
                raise ValueError(
                    f"TransformerSpec: dim={self.dim} is not a multiple of heads={self.heads}; "
                    "give head_dim= explicitly.")
            object.__setattr__(self, "head_dim", self.dim // self.heads)
        if self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ValueError(
                f"TransformerSpec: kv_heads={self.kv_heads} must be >= 1 and divide "
                f"heads={self.heads} (grouped-query attention).")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"TransformerSpec: mlp={self.mlp!r} must be one of {MLP_KINDS}.")
        if self.experts:
            if not 1 <= self.top_k <= self.experts or self.expert_ffn < 1:
                raise ValueError(
                    f"TransformerSpec: an MoE needs 1 <= top_k <= experts and expert_ffn >= 1; "
                    f"got experts={self.experts}, top_k={self.top_k}, "
                    f"expert_ffn={self.expert_ffn}.")
            if not 0 <= self.dense_layers < self.layers:
                raise ValueError(
                    f"TransformerSpec: dense_layers={self.dense_layers} must be in "
                    f"[0, layers={self.layers}).")
        elif self.top_k or self.expert_ffn or self.shared_experts or self.dense_layers:
            raise ValueError("TransformerSpec: top_k, expert_ffn, shared_experts and "
                             "dense_layers need experts >= 1.")

    # -- widths -------------------------------------------------------------------------
    @functools.cached_property
    def q_dim(self) -> int:
        """``heads x head_dim``: the width of the queries (and of attention's output)."""
        return self.heads * self.head_dim

    @functools.cached_property
    def kv_dim(self) -> int:
        """``kv_heads x head_dim``: the width of the keys (and of the values)."""
        return self.kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @functools.cached_property
    def moe_layers(self) -> int:
        """Blocks with an MoE MLP."""
        return self.layers - self.dense_layers if self.is_moe else 0

    # -- parameters ---------------------------------------------------------------------
    @functools.cached_property
    def attention_params(self) -> int:
        """One block's attention matrices (q, k, v, o)."""
        return 2 * self.dim * self.q_dim + 2 * self.dim * self.kv_dim

    def _mlp_params(self, width: int) -> int:
        return (3 if self.mlp == "swiglu" else 2) * self.dim * width

    @functools.cached_property
    def dense_mlp_params(self) -> int:
        """One dense MLP's matrices."""
        return self._mlp_params(self.ffn)

    @functools.cached_property
    def expert_params(self) -> int:
        """One expert's matrices (SwiGLU, or GeLU for ``mlp="gelu"``)."""
        return self._mlp_params(self.expert_ffn) if self.is_moe else 0

    @functools.cached_property
    def shared_params_per_moe_layer(self) -> int:
        """An MoE block's parameters that every ep rank holds: attention, router, shared experts,
        norms."""
        return (self.attention_params + self.dim * self.experts
                + self.shared_experts * self.expert_params + 2 * self.dim)

    @functools.cached_property
    def dense_block_params(self) -> int:
        return self.attention_params + self.dense_mlp_params + 2 * self.dim

    @functools.cached_property
    def embedding_params(self) -> int:
        """The embedding and (when not tied) the output head, and the final norm."""
        return self.vocab * self.dim * (1 if self.tied_embeddings else 2) + self.dim

    @functools.cached_property
    def routed_expert_params(self) -> int:
        """All routed experts of all MoE blocks (what expert parallelism splits)."""
        return self.moe_layers * self.experts * self.expert_params

    @functools.cached_property
    def non_expert_params(self) -> int:
        """Every parameter outside the routed experts."""
        dense = self.layers - self.moe_layers
        return (dense * self.dense_block_params
                + self.moe_layers * self.shared_params_per_moe_layer + self.embedding_params)

    @functools.cached_property
    def params(self) -> int:
        """All parameters."""
        return self.non_expert_params + self.routed_expert_params

    @functools.cached_property
    def active_params(self) -> int:
        """The parameters one token's forward uses (``top_k`` routed experts per MoE block)."""
        return (self.non_expert_params
                + self.moe_layers * self.top_k * self.expert_params)

    @property
    def block_tensors(self) -> int:
        """Parameter tensors of one block: q, k, v, o, the MLP's matrices (the routed experts
        stacked, the shared ones, the router), two norms."""
        mlp = 3 if self.mlp == "swiglu" else 2
        if self.is_moe:
            mlp = mlp * (2 if self.shared_experts else 1) + 1
        return 4 + mlp + 2

    # -- FLOPs --------------------------------------------------------------------------
    def block_matmul_params(self, moe: bool) -> int:
        """The matrix parameters one token meets in one block (active experts for an MoE)."""
        if not moe:
            return self.attention_params + self.dense_mlp_params
        return (self.attention_params + self.dim * self.experts
                + (self.top_k + self.shared_experts) * self.expert_params)

    def attention_flops_per_token(self, seq_len: int) -> float:
        """One block's ``QK^T`` and ``AV`` FLOPs per token, forward (full ``s x s``)."""
        return 4.0 * seq_len * self.q_dim

    def forward_flops_per_token(self, seq_len: int) -> float:
        """The whole model's forward FLOPs per token, output head included."""
        dense = self.layers - self.moe_layers
        blocks = (dense * 2.0 * self.block_matmul_params(False)
                  + self.moe_layers * 2.0 * self.block_matmul_params(True))
        return blocks + self.layers * self.attention_flops_per_token(seq_len) + (
            2.0 * self.vocab * self.dim)

    def train_flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of a training step per token: 3x the forward (no recomputation)."""
        return 3.0 * self.forward_flops_per_token(seq_len)

    def describe(self) -> str:
        """One line: the name, the sizes and the parameter count."""
        moe = (f", {self.experts} experts top-{self.top_k} x {self.expert_ffn}"
               if self.is_moe else "")
        return (f"{self.name}: {self.layers} layers, dim {self.dim}, {self.heads} heads "
                f"({self.kv_heads} kv), {self.mlp} ffn {self.ffn}, vocab {self.vocab}{moe}; "
                f"{self.params / 1e9:.2f}B params ({self.active_params / 1e9:.2f}B active)")
