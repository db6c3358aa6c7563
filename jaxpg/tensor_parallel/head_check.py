"""Tensor parallelism against attention heads, checked before anything runs.

A column split gives each tp rank whole heads only if tp divides the head count: with 3 heads
and tp = 2 each rank's slice of the projection holds 1.5 heads, and the model's own
``reshape(..., heads, head_dim)`` fails later with a raw ``cannot reshape`` error.
:func:`check_heads` reads what the module tree says of its heads when
``parallelize_module`` applies a plan: for each split Linear, the nearest enclosing module
that names a head size or head count,

* ``head_dim`` (or ``head_size``, ``d_head``): the split width must hold a multiple of tp
  heads of that size (a projection whose width is no multiple of ``head_dim`` is not split
  by heads, and is left alone);
* a head count (``num_heads``, ``num_kv_heads``, ``num_key_value_heads``, ``n_heads``,
  ``heads``, ...) on a module that is attention (its class or attribute name says
  ``attn`` or ``attention``): tp must divide each count.

A model that names neither is not checked here; :mod:`jaxpg.models` plans check their
configs' heads and kv-heads themselves.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from jaxpg.groups.mesh_axis import MeshAxis
from jaxpg.tensor_parallel.styles import ColwiseParallel, RowwiseParallel

__all__ = ["HEAD_COUNT_ATTRS", "HEAD_SIZE_ATTRS", "check_heads"]

HEAD_SIZE_ATTRS = ("head_dim", "head_size", "d_head")
HEAD_COUNT_ATTRS = ("num_heads", "num_kv_heads", "num_key_value_heads", "num_attention_heads",
                    "n_heads", "n_kv_heads", "n_head", "heads", "kv_heads")


def _ints(module: Any, names: tuple[str, ...]) -> dict[str, int]:
    out = {}
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[name] = value
    return out


def _is_attention(path: str, module: Any) -> bool:
    words = (type(module).__name__.lower(), path.rsplit(".", 1)[-1].lower())
    return any("attn" in w or "attention" in w for w in words)


def _fits(n: int, tp: int) -> str:
    fits = [d for d in range(1, n + 1) if n % d == 0]
    return f"use a tp that divides {n} (one of {fits}), or a head count that {tp} divides"


def check_heads(root: nnx.Module, entries: list[tuple[str, Any, Any]], tp: MeshAxis,
                api: str) -> None:
    """Raises if a plan's split gives some tp rank a fraction of an attention head.

    Args:
        root: the module the plan is applied to.
        entries: the plan's ``(path, submodule, style)`` triples.
        tp: the tensor-parallel mesh.
        api: the caller's name, for errors.

    Raises:
        ValueError: naming the tp degree, the split submodule, the head size or count, and
            the degrees that fit.
    """
    n = tp.size
    if n == 1:
        return
    modules = {".".join(str(p) for p in path): node for path, node in nnx.iter_graph(root)
               if isinstance(node, nnx.Module)}
    for path, sub, style in entries:
        if not isinstance(style, ColwiseParallel | RowwiseParallel) or \
                not isinstance(sub, nnx.Linear):
            continue
        width, what = style._split_size(sub, "linear")
        parts = path.split(".") if path else []
        for cut in range(len(parts) - 1, -1, -1):  # the nearest enclosing module first
            owner_path = ".".join(parts[:cut])
            owner = modules.get(owner_path)
            sizes, counts = _ints(owner, HEAD_SIZE_ATTRS), _ints(owner, HEAD_COUNT_ATTRS)
            owner_name = owner_path or "(root)"
            for name, size in sizes.items():
                heads = width // size
                if width % size == 0 and heads % n:
                    raise ValueError(
                        f"{api}: tp={n} (device_mesh) splits {path!r} ({type(style).__name__},"
                        f" {what}={width}: {heads} heads of {owner_name}.{name}={size}) into "
                        f"{heads}/{n} heads per rank; {_fits(heads, n)}.")
            if _is_attention(owner_path, owner):
                for name, count in counts.items():
                    if count % n:
                        raise ValueError(
                            f"{api}: tp={n} (device_mesh) does not divide "
                            f"{owner_name}.{name}={count}, and the plan splits {path!r} "
                            f"({type(style).__name__}) of that attention over tp: each rank "
                            f"would hold {count}/{n} heads; {_fits(count, n)}.")
            if sizes or counts:
                break
