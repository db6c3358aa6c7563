"""Model FLOPs, MFU and memory for the recipe's metrics.

FLOPs per trained token are the planner's (:meth:`jaxpg.plan.TransformerSpec.
train_flops_per_token`): three times the forward's matmuls (``6N`` for the ``N`` matmul
parameters a token meets, the output head included) plus attention's ``QK^T`` and ``AV``
over the whole sequence. MFU is the achieved model FLOP/s over the devices' peak from a
hardware profile (:mod:`jaxpg.plan.hardware`).
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Any

import jax

from jaxpg.plan.calibrate import calibrate
from jaxpg.plan.hardware import HARDWARE, Hardware, load_hardware
from jaxpg.plan.spec import TransformerSpec

__all__ = ["model_spec", "train_flops_per_token", "resolve_hardware", "memory_in_use"]


def model_spec(config: Any) -> TransformerSpec:
    """The planner's :class:`TransformerSpec` of a ``jaxpg.models`` config."""
    moe = {}
    if getattr(config, "num_experts", 0):
        dense = sum(1 for i in range(config.num_layers) if not config.is_moe_layer(i))
        moe = dict(experts=config.num_experts, top_k=config.num_experts_per_tok,
                   expert_ffn=config.moe_intermediate_size, dense_layers=dense)
    return TransformerSpec(
        layers=config.num_layers, dim=config.hidden_size, heads=config.num_heads,
        ffn=config.intermediate_size, vocab=config.vocab_size, kv_heads=config.num_kv_heads,
        head_dim=config.head_dim, tied_embeddings=config.tie_word_embeddings,
        name=type(config).__name__, **moe)


def train_flops_per_token(config: Any, seq_len: int) -> float:
    """Model FLOPs of one trained token (forward and backward, no recomputation)."""
    return model_spec(config).train_flops_per_token(seq_len)


def resolve_hardware(name: str) -> Hardware:
    """A hardware profile: a preset name, a TOML file, or ``calibrate`` (this machine)."""
    if name == "calibrate":
        return calibrate(dtype="fp32", matmul_size=256, stream_mib=4, repeats=3)
    if name in HARDWARE:
        return HARDWARE[name]
    if os.path.isfile(name):
        return load_hardware(name)
    raise ValueError(f"jaxpg.train config: metrics.hardware={name!r} is neither a preset "
                     f"({sorted(HARDWARE)}), a hardware TOML file, nor 'calibrate'.")


def memory_in_use() -> tuple[int, str]:
    """``(bytes, source)``: the largest ``bytes_in_use`` of this process's devices when
    they report memory stats (``"device"``), else this process's peak resident set
    (``"host_rss"``)."""
    stats = [d.memory_stats() for d in jax.local_devices()]
    used = [s.get("bytes_in_use") for s in stats if s]
    if used and all(u is not None for u in used):
        return int(max(used)), "device"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "host_rss"
