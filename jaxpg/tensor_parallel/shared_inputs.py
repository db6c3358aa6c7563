"""One gradient reduction for a module input that several column-parallel layers consume.

A column-parallel matmul turns a replicated input into per-rank partial input gradients, so
each column-parallel layer sums them itself (Megatron's ``f``: an all-reduce in the
backward). When a module's input feeds several of them (``wq``, ``wk``, ``wv``), that is one
all-reduce each, where Megatron (a fused QKV) and torch (whose DTensor sums the ``Partial``
gradients before redistributing) need one in all.

``PrepareModuleInput`` gets the one: while its module runs, it registers each prepared input
here together with a twin whose backward sums partial gradients once (an all-reduce, or with
sequence parallelism a reduce-scatter). A column-parallel layer whose input *is* a
registered value (the same traced object) takes the twin and skips its own ``f``. Any other
use of the value keeps its ordinary backward, so the two kinds of gradient never mix.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["sharing", "shared_twin"]

_local = threading.local()


def _stack() -> list[dict[int, tuple[Any, Any]]]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


@contextlib.contextmanager
def sharing(pairs: list[tuple[Any, Any]]) -> Iterator[None]:
    """Registers ``(value, twin)`` pairs while the block runs (a module's call)."""
    _stack().append({id(v): (v, t) for v, t in pairs})
    try:
        yield
    finally:
        _stack().pop()


def shared_twin(x: Any) -> Any | None:
    """The registered twin of ``x`` (the very object), or None."""
    for scope in reversed(_stack()):
        entry = scope.get(id(x))
        if entry is not None and entry[0] is x:
            return entry[1]
    return None
