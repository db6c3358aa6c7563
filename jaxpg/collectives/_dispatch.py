"""Shared front matter of every collective: resolve the group, pick the lowering."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpg.groups import world as _world
from jaxpg.reduce_op import ReduceOp, as_reduce_op
from jaxpg.spmd_lowering import SpmdContext, current_context

__all__ = ["resolve", "is_traced", "check_same_shapes", "group_rank_of", "checked_op",
           "check_input", "check_inputs", "torch_form_error"]

_checked_ops: dict[tuple[Any, Any], ReduceOp] = {}
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_ARRAYS = (jax.Array, np.ndarray, np.generic, int, float, complex, bool)

# torch's signatures that write into an output argument, and jaxpg's form that returns it
TORCH_FORMS = {
    "all_gather": ("all_gather(tensor_list, tensor)", "tensor_list = jaxpg.all_gather(tensor)"),
    "all_gather_into_tensor": ("all_gather_into_tensor(output_tensor, input_tensor)",
                               "output_tensor = jaxpg.all_gather_into_tensor(input_tensor)"),
    "all_to_all": ("all_to_all(output_tensor_list, input_tensor_list)",
                   "output_tensor_list = jaxpg.all_to_all(input_tensor_list)"),
    "all_to_all_single": (
        "all_to_all_single(output, input, output_split_sizes, input_split_sizes)",
        "output = jaxpg.all_to_all_single(input, output_split_sizes, input_split_sizes)"),
    "reduce_scatter": ("reduce_scatter(output, input_list, op)",
                       "output = jaxpg.reduce_scatter(input_list, op)"),
    "reduce_scatter_tensor": ("reduce_scatter_tensor(output, input, op)",
                              "output = jaxpg.reduce_scatter_tensor(input, op)"),
    "gather": ("gather(tensor, gather_list, dst)",
               "gather_list = jaxpg.gather(tensor, dst=dst)  (the list on dst, None elsewhere)"),
    "all_gather_object": ("all_gather_object(object_list, obj)",
                          "object_list = jaxpg.all_gather_object(obj)"),
}


def _is_data(x: Any) -> bool:
    return isinstance(x, (*_ARRAYS, list, tuple)) or hasattr(x, "__array__")


def torch_form_error(api: str) -> TypeError:
    """The TypeError for torch's output-argument form of ``api``, showing jaxpg's form."""
    torch_sig, ours = TORCH_FORMS[api]
    return TypeError(
        f"{api}: this looks like torch's {torch_sig}, which writes into its output argument. "
        f"jaxpg returns the result instead (JAX arrays cannot change): {ours}."
    )


def resolve(group: Any, api: str) -> tuple[Any, SpmdContext | None]:
    """Returns ``(ProcessGroup, active SPMD context or None)``.

    An array or list where the group belongs is torch's output-argument form
    (``all_gather(tensor_list, tensor)``): the TypeError shows jaxpg's form.
    """
    if group is not None and api in TORCH_FORMS and _is_data(group):
        raise torch_form_error(api)
    pg = _world._resolve_group(group, api)
    return pg, current_context()


NARROW_64 = {np.dtype(np.float64): np.float32, np.dtype(np.complex128): np.complex64,
             np.dtype(np.int64): np.int32, np.dtype(np.uint64): np.uint32}


def _check_64bit(x: np.ndarray | np.generic, api: str, arg: str) -> None:
    """With JAX's x64 mode off, 64-bit numpy data is narrowed as ``jnp.asarray`` narrows
    it, never silently: float64/complex128 warn (once per op and dtype), int64 values
    outside int32 raise."""
    narrow = NARROW_64.get(x.dtype)
    if narrow is None or jax.config.jax_enable_x64:
        return
    if x.dtype.kind in "iu":
        info = np.iinfo(narrow)
        if x.size and (x.min() < info.min or x.max() > info.max):
            raise ValueError(
                f"{api}: {arg} is {x.dtype} with values outside {np.dtype(narrow).name}'s "
                f"range [{info.min}, {info.max}], and JAX's x64 mode is off, so they cannot "
                "be kept; turn x64 on (jax.config.update('jax_enable_x64', True) before any "
                "JAX work), or pass smaller values.")
        return
    warnings.warn(
        f"{api}: {arg} is {x.dtype} and becomes {np.dtype(narrow).name}, as jnp.asarray "
        f"makes it, because JAX's x64 mode is off. Pass {np.dtype(narrow).name} data to "
        "silence this, or turn x64 on (jax.config.update('jax_enable_x64', True) before any "
        f"JAX work) to keep {x.dtype}.", UserWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside jaxpg."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


def check_inputs(x: Any, api: str, arg: str = "tensor") -> None:
    """:func:`check_input` for an argument that may also be a list of arrays (one per
    local rank, or several tensors sent together); a list of plain numbers is refused."""
    if not isinstance(x, (list, tuple)):
        check_input(x, api, arg)
    elif not x or all(isinstance(v, (int, float, complex)) for v in x):
        check_input(x, api, arg)  # raises: a list of numbers is data, not arrays
    else:
        for i, v in enumerate(x):
            check_input(v, api, f"{arg}[{i}]")


def check_input(x: Any, api: str, arg: str = "tensor") -> None:
    """Raises a TypeError naming ``api`` and the conversion when ``x`` is not an array.

    JAX arrays (traced ones too), numpy arrays and Python scalars pass; so does anything
    with ``__jax_array__`` or ``__array__`` (except a torch tensor, whose conversion needs
    ``.numpy()``). A Python list is refused: a collective takes one array per rank.
    64-bit numpy data with JAX's x64 mode off: see ``_check_64bit``.
    """
    if isinstance(x, _ARRAYS):
        if isinstance(x, (np.ndarray, np.generic)) and x.dtype in NARROW_64:
            _check_64bit(x, api, arg)
        return
    kind = type(x)
    if kind.__module__.split(".")[0] == "torch":
        raise TypeError(
            f"{api}: {arg} is a {kind.__module__}.{kind.__name__}; jaxpg collectives take JAX "
            f"or numpy arrays. Convert it: jnp.asarray({arg}.numpy()) (with "
            f"{arg}.detach().cpu().numpy() for a tensor that requires grad or is on a GPU)."
        )
    if isinstance(x, (list, tuple)):
        raise TypeError(
            f"{api}: {arg} is a Python {kind.__name__}; jaxpg collectives take one array per "
            f"rank. Convert it: jnp.asarray({arg}) (e.g. jnp.asarray([1.0, 2.0, 3.0]))."
        )
    if hasattr(x, "__jax_array__") or hasattr(x, "__array__"):
        return
    raise TypeError(
        f"{api}: {arg} must be a JAX or numpy array (or a Python number); got "
        f"{kind.__name__}. Convert it with jnp.asarray(...)."
    )


def checked_op(op: Any, x: Any, api: str) -> ReduceOp:
    """``as_reduce_op(op, dtype of x)``, remembered per (op, dtype): a small eager call
    should not pay for the dtype checks every time."""
    dtype = x.dtype if isinstance(x, (jax.Array, np.ndarray)) else jnp.result_type(x)
    try:
        key = (op, dtype)
        checked = _checked_ops.get(key)
    except TypeError:  # an unhashable op: as_reduce_op says what is wrong with it
        return as_reduce_op(op, dtype, api=api)
    if checked is None:
        checked = as_reduce_op(op, dtype, api=api)
        if len(_checked_ops) >= 1024:  # e.g. a new PREMUL_SUM factor every step
            _checked_ops.clear()
        _checked_ops[key] = checked
    return checked


def is_traced(x: Any) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(x))


def check_same_shapes(arrays: list[Any], api: str, arg: str) -> None:
    """Raises if the arrays of a list argument differ in shape or dtype."""
    def sig(a: Any) -> tuple:
        return np.shape(a), str(jnp.result_type(a))

    first = sig(arrays[0])
    for i, a in enumerate(arrays[1:], 1):
        if sig(a) != first:
            raise ValueError(
                f"{api}: every array in {arg} must have the same shape and dtype; {arg}[0] is "
                f"{first[0]} {first[1]} but {arg}[{i}] is {sig(a)[0]} {sig(a)[1]}."
            )


def group_rank_of(pg: Any, global_rank: int | None, group_rank: int | None, api: str,
                  arg: str) -> int:
    """Turns torch's ``src``/``dst`` (global) or ``group_src``/``group_dst`` into a group rank."""
    if global_rank is not None and group_rank is not None:
        raise ValueError(f"{api}: pass {arg} or group_{arg}, not both.")
    if group_rank is not None:
        if not 0 <= group_rank < pg.size():
            raise ValueError(
                f"{api}: group_{arg}={group_rank} is out of range for group "
                f"{pg.group_name!r} of size {pg.size()}."
            )
        return int(group_rank)
    if global_rank is None:
        global_rank = 0
    r = pg.group_rank(global_rank)
    if r < 0:
        raise ValueError(
            f"{api}: {arg}={global_rank} is not a rank of group {pg.group_name!r} "
            f"(ranks {list(pg.ranks)}); pass a global rank of the group, or group_{arg}."
        )
    return r
