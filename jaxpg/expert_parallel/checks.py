"""``moe``'s argument checks: every bad input raises before anything runs."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["check_moe_args"]


def check_moe_args(x: Any, gate_w: Any, w1: Any, w2: Any, ep: int, top_k: Any,
                   capacity_factor: Any, api: str = "moe",
                   replicated_tokens: Any = False) -> tuple[int, int, int, int]:
    """Checks one rank's arguments; returns ``(tokens, d, E, E_local)``.

    Raises:
        ValueError: for shapes that do not fit together, E not divisible by ep, top_k
            outside ``[1, E]`` or a capacity factor that is not positive.
        TypeError: for a top_k that is not an int.
    """
    shapes = {n: tuple(np.shape(a)) for n, a in
              (("x", x), ("gate_w", gate_w), ("w1", w1), ("w2", w2))}
    if len(shapes["x"]) != 2:
        raise ValueError(f"{api}: x must be (tokens_local, d) on each rank; got shape "
                         f"{shapes['x']}.")
    tokens, d = shapes["x"]
    if len(shapes["gate_w"]) != 2 or shapes["gate_w"][0] != d:
        raise ValueError(f"{api}: gate_w must be (d, E) = ({d}, E) for x of width d={d}; got "
                         f"shape {shapes['gate_w']}.")
    num_experts = shapes["gate_w"][1]
    if num_experts % ep:
        raise ValueError(f"{api}: the number of experts E={num_experts} (gate_w's width) "
                         f"must be divisible by the expert-parallel degree ep={ep}; use E a "
                         f"multiple of {ep} or another group.")
    local = num_experts // ep
    if len(shapes["w1"]) != 3 or shapes["w1"][:2] != (local, d):
        raise ValueError(f"{api}: w1 must be (E_local, d, f) = ({local}, {d}, f) on each rank "
                         f"(E={num_experts} experts over ep={ep} ranks); got shape "
                         f"{shapes['w1']}.")
    hidden = shapes["w1"][2]
    # a gated activation (SwiGLU on [gate | up] rows) halves the width: w2 then takes f / 2
    if shapes["w2"] not in ((local, hidden, d), (local, hidden // 2, d)) or (
            shapes["w2"][1] != hidden and hidden % 2):
        raise ValueError(f"{api}: w2 must be (E_local, f, d) = ({local}, {hidden}, {d}) to "
                         f"match w1 {shapes['w1']} (or ({local}, {hidden // 2}, {d}) for a "
                         f"gated activation that halves the width); got shape "
                         f"{shapes['w2']}.")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
        raise TypeError(f"{api}: top_k must be an int; got {top_k!r}.")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"{api}: top_k={top_k} must be between 1 and the number of experts "
                         f"E={num_experts}.")
    if capacity_factor is not None and not (
            isinstance(capacity_factor, (int, float, np.floating, np.integer))
            and float(capacity_factor) > 0):
        raise ValueError(f"{api}: capacity_factor={capacity_factor!r} must be a positive "
                         "number, or None for dropless routing.")
    if not isinstance(replicated_tokens, bool):
        raise TypeError(f"{api}: replicated_tokens must be a bool; got {replicated_tokens!r}.")
    if replicated_tokens and tokens % ep:
        raise ValueError(f"{api}: replicated_tokens=True splits the {tokens} tokens over the "
                         f"ep={ep} ranks; pass a number of tokens divisible by {ep}.")
    return tokens, d, num_experts, local


def check_buffer_factor(buffer_factor: Any, api: str = "moe") -> float | None:
    """``buffer_factor`` itself: None or a number of at least 1.

    Raises:
        ValueError: for anything else.
    """
    if buffer_factor is None:
        return None
    if (isinstance(buffer_factor, bool)
            or not isinstance(buffer_factor, (int, float, np.floating, np.integer))
            or not float(buffer_factor) >= 1):
        raise ValueError(f"{api}: buffer_factor={buffer_factor!r} must be a number >= 1 (a "
                         "multiple of the balanced load) or None (always the worst-case "
                         "buffers).")
    return float(buffer_factor)
