"""Which Hugging Face tensors make each parameter, and how a slice of one is read.

A parameter's path is its checkpoint name without ``model.``: the norms and the embedding
keep their orientation, a Linear ``kernel`` ``[in, out]`` is the transposed ``weight``
``[out, in]``, the router ``gate`` ``(d, E)`` the transposed ``mlp.gate.weight``, and the
experts' ``w1`` ``(E, d, 2f)`` holds each expert's ``gate_proj`` and ``up_proj`` (both
``[f, d]``) transposed side by side, ``w2`` ``(E, f, d)`` its transposed ``down_proj``.
:func:`read_slice` reads exactly the rows and columns a device's block needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["hf_sources", "read_slice", "hf_tensors"]

Reader = Callable[[str, tuple[slice, ...]], np.ndarray]


def _hf_name(path: str) -> str:
    return path if path.startswith("lm_head.") else f"model.{path}"


def _base(path: str) -> str:
    return path.rsplit(".", 1)[0]


def hf_sources(path: str, shape: tuple[int, ...]) -> list[str]:
    """The Hugging Face tensor names parameter ``path`` (of ``shape``) is made of."""
    leaf = path.rsplit(".", 1)[1]
    if leaf in ("w1", "w2"):
        layer = _hf_name(_base(path))
        parts = ("gate_proj", "up_proj") if leaf == "w1" else ("down_proj",)
        return [f"{layer}.experts.{e}.{p}.weight" for e in range(shape[0]) for p in parts]
    if leaf == "gate":
        return [f"{_hf_name(_base(path))}.gate.weight"]
    return [_hf_name(_base(path) + ".weight")]


def _norm(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return [s.indices(n)[:2] for s, n in zip(index, shape)]


def read_slice(path: str, shape: tuple[int, ...], index: tuple[slice, ...], read: Reader
               ) -> np.ndarray:
    """Block ``index`` of parameter ``path``, reading only those parts of its tensors.

    Args:
        path: the parameter's dotted path.
        shape: its full shape.
        index: the block (a tuple of slices, as ``make_array_from_callback`` passes).
        read: ``read(hf_name, slices)``: that slice of a checkpoint tensor.
    """
    bounds = _norm(index, shape)
    leaf = path.rsplit(".", 1)[1]
    names = hf_sources(path, shape)
    if leaf == "w1":
        (e0, e1), (d0, d1), (h0, h1) = bounds
        f = shape[2] // 2
        experts = []
        for e in range(e0, e1):
            cols = []
            for part, lo in ((0, 0), (1, f)):
                a, b = max(h0 - lo, 0), min(h1 - lo, f)
                if a < b:
                    cols.append(read(names[2 * e + part], (slice(a, b), slice(d0, d1))).T)
            experts.append(np.concatenate(cols, axis=1))
        return np.stack(experts)
    if leaf == "w2":
        (e0, e1), (f0, f1), (d0, d1) = bounds
        return np.stack([read(names[e], (slice(d0, d1), slice(f0, f1))).T
                         for e in range(e0, e1)])
    slices = tuple(slice(a, b) for a, b in bounds)
    if leaf in ("kernel", "gate"):
        return read(names[0], slices[::-1]).T
    return read(names[0], slices)


def hf_tensors(path: str, shape: tuple[int, ...]
               ) -> list[tuple[str, tuple[int, ...], Callable[[Any], Any]]]:
    """``(hf_name, hf_shape, extract)`` per checkpoint tensor of parameter ``path``:
    ``extract(array)`` (traced, on the parameter's global array) gives the tensor."""
    leaf = path.rsplit(".", 1)[1]
    names = hf_sources(path, shape)
    if leaf == "w1":
        n, d, two_f = shape
        f = two_f // 2
        out = []
        for e in range(n):
            out.append((names[2 * e], (f, d), lambda a, e=e, f=f: a[e, :, :f].T))
            out.append((names[2 * e + 1], (f, d), lambda a, e=e, f=f: a[e, :, f:].T))
        return out
    if leaf == "w2":
        n, f, d = shape
        return [(names[e], (d, f), lambda a, e=e: a[e].T) for e in range(n)]
    if leaf in ("kernel", "gate"):
        return [(names[0], shape[::-1], lambda a: a.T)]
    return [(names[0], shape, lambda a: a)]
