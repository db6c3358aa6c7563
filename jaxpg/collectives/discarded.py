"""A warning when host code throws a collective's result away (a torch habit).

torch's collectives write into their arguments (``dist.all_reduce(t)`` changes ``t``);
jaxpg's return the result, because JAX arrays cannot change. Ported code that keeps the
torch line ``dist.all_reduce(t)`` computes the sum and drops it, and ``t`` keeps its old
values: wrong numbers, no error. So an eager call made from host code whose result is
discarded, the statement being nothing but the call, warns
(:class:`~jaxpg.errors.DiscardedResultWarning`, once per line)::

    jaxpg.all_reduce(t)        # warns: use t = jaxpg.all_reduce(t)

How it knows: CPython compiles an expression statement to the call followed by
``POP_TOP``, which drops the value; the wrapper looks at the instruction after the caller's
current one (``dis``, cached per code object and offset: a microsecond or two per call).
What it does not see, and so never warns about: a result dropped by a function in between
(``def f(x): jaxpg.all_reduce(x)`` warns at that line, but a wrapper that returns the result
to a caller who drops it does not), a result stored and never read, SPMD code (a traced
result nobody uses is dead code that XLA removes), ``async_op=True`` (a ``Work``: torch code
keeps ``work.wait()`` and then reads the old tensor, which only the porting guide can point
out), and interpreters other than CPython. ``_ = jaxpg.all_reduce(t)`` silences it for one
line; ``warnings.filterwarnings("ignore", category=jaxpg.DiscardedResultWarning)`` for all.
"""

from __future__ import annotations

import dis
import functools
import sys
import warnings
from collections.abc import Callable
from types import CodeType
from typing import Any

import jax

from jaxpg.errors import DiscardedResultWarning

__all__ = ["warns_if_discarded"]

# wrappers between the user's line and this one (``non_member.skips_non_members``)
PASS_THROUGH: set[CodeType] = set()
_after: dict[tuple[CodeType, int], bool] = {}  # (code, f_lasti) -> the next op is POP_TOP
_HINTS = {
    "recv": "tensor = jaxpg.recv(tensor, src)",
    "gather": "gather_list = jaxpg.gather(tensor, dst=...)",
    "scatter": "tensor = jaxpg.scatter(tensor, scatter_list, src=...)",
    "all_gather": "tensor_list = jaxpg.all_gather(tensor)",
    "all_to_all": "output_list = jaxpg.all_to_all(input_list)",
    "broadcast_object_list": "object_list = jaxpg.broadcast_object_list(object_list, src=...)",
}


def _discarded_at(code: CodeType, lasti: int) -> bool:
    """Whether the instruction after the call at ``lasti`` drops its value (``POP_TOP``).

    ``f_lasti`` is the call's offset on Python 3.12+ and may point inside its inline cache
    on 3.11, so the next instruction is the first one after it."""
    key = (code, lasti)
    found = _after.get(key)
    if found is None:
        if len(_after) > 4096:
            _after.clear()
        nxt = next((i for i in dis.get_instructions(code) if i.offset > lasti), None)
        found = _after[key] = nxt is not None and nxt.opname == "POP_TOP"
    return found


def _traced(result: Any) -> bool:
    leaves = jax.tree.leaves(result)
    return bool(leaves) and isinstance(leaves[0], jax.core.Tracer)


def warns_if_discarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a collective so that discarding its eager result warns (see the module doc)."""
    api = fn.__name__
    hint = _HINTS.get(api, f"tensor = jaxpg.{api}(tensor, ...)")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        if result is None or type(result).__name__ in ("Work", "_DeferredWork", "P2PWork"):
            return result
        caller, level = sys._getframe(1), 2
        while caller.f_code in PASS_THROUGH:
            caller, level = caller.f_back, level + 1
        if _discarded_at(caller.f_code, caller.f_lasti) and not _traced(result):
            warnings.warn(
                f"the result of jaxpg.{api} is discarded: jaxpg returns the result instead of "
                f"changing its arguments in place as torch.distributed does (JAX arrays "
                f"cannot change), so this call has no effect. Keep it: {hint}.",
                DiscardedResultWarning, stacklevel=level)
        return result

    return wrapper
