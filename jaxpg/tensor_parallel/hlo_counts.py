"""Counting the collectives of a compiled step, to hold it against Megatron's count."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["collective_counts", "collective_bytes", "COLLECTIVES"]

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}


def _instructions(compiled: Any):
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    for line in text.splitlines():
        for op in COLLECTIVES:
            m = re.search(rf"=\s*(.*?)\s{op}(-start)?\(", line)
            if m:
                yield op, m.group(2) is not None, m.group(1)


def collective_counts(compiled: Any) -> dict[str, int]:
    """How many collective instructions of each kind the optimised HLO issues.

    Args:
        compiled: a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``) or its
            ``as_text()``.

    Returns:
        ``{"all-reduce": n, "all-gather": n, ...}``. An asynchronous pair (``-start`` and
        ``-done``) counts once. XLA's combiners may merge several collectives into one
        instruction, which counts once (it is one collective on the wire): compare bytes
        with :func:`collective_bytes`.
    """
    counts = dict.fromkeys(COLLECTIVES, 0)
    for op, _, _ in _instructions(compiled):
        counts[op] += 1
    return counts


def collective_bytes(compiled: Any) -> dict[str, int]:
    """The bytes of the results of each kind of collective, summed over the HLO.

    For an all-reduce that is the data reduced; for an all-gather the gathered result; for a
    reduce-scatter each rank's share.
    """
    total = dict.fromkeys(COLLECTIVES, 0)
    for op, started, result in _instructions(compiled):
        shapes = re.findall(r"(\w+)\[([\d,]*)\]", result)
        if started:  # an async start's result holds its operands, then its results
            shapes = shapes[len(shapes) // 2:]
        for dtype, dims in shapes:
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            total[op] += n * _BYTES.get(dtype, 4)
    return total
