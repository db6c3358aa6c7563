"""Small helpers for code that runs inside ``shard_map`` over a named mesh axis.

A DDP "group" inside ``jit`` is one mesh axis name, or a tuple of them. These
helpers normalise that name, read the group's size, and move values between the
"invariant" and "varying" manual-axis types that ``shard_map`` checks
(``check_vma=True``), so that both branches of a ``lax.cond`` agree.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax

AxisName = Hashable | tuple[Hashable, ...]


def axis_tuple(axis_name: AxisName) -> tuple[Hashable, ...]:
    """Returns ``axis_name`` as a tuple of mesh axis names.

    Raises:
        TypeError: if ``axis_name`` is not a string (or hashable name) or a
            non-empty tuple of them.
    """
    if isinstance(axis_name, tuple):
        if not axis_name:
            raise TypeError(
                "axis_name=() names no mesh axis; pass the name of the data-parallel "
                "axis of the shard_map mesh, e.g. axis_name='dp'."
            )
        return axis_name
    if isinstance(axis_name, list):
        return tuple(axis_name)
    if axis_name is None or not isinstance(axis_name, Hashable):
        raise TypeError(
            f"{axis_name=} is not a mesh axis name; pass a string such as 'dp' or a "
            "tuple of axis names."
        )
    return (axis_name,)


def axis_size(axis_name: AxisName) -> int:
    """The number of ranks along ``axis_name`` (a product over a tuple of axes).

    Must be called inside ``shard_map`` (or another context binding the axes).
    """
    size = 1
    for name in axis_tuple(axis_name):
        size *= jax.lax.axis_size(name)
    return size


def _varying_axes(x: Any) -> frozenset:
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        manual = getattr(aval, "manual_axis_type", None)
        vma = getattr(manual, "varying", frozenset()) if manual is not None else frozenset()
    return frozenset(vma)


def to_varying(x: Any, axis_name: AxisName) -> Any:
    """Marks every array leaf of ``x`` as varying over ``axis_name``.

    Values that already vary are left alone, so the call is idempotent. Under
    ``check_vma=False`` nothing is tracked and this is a no-op cast.
    """
    axes = axis_tuple(axis_name)

    def cast(leaf):
        missing = tuple(a for a in axes if a not in _varying_axes(leaf))
        return jax.lax.pcast(leaf, missing, to="varying") if missing else leaf

    return jax.tree_util.tree_map(cast, x)
