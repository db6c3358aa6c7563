"""A process outside a group that calls its collective: torch 2.13's warning, no call.

``new_group`` gives a process that holds none of the group's ranks
``GroupMember.NON_GROUP_MEMBER``. torch's collectives, given that sentinel, warn
``Running <op> on global rank <r> which does not belong to the given group.`` and return
without communicating (``_warn_not_in_group``), leaving their tensors as they were;
:func:`skips_non_members` gives each of jaxpg's collectives the same behaviour. jaxpg's
collectives return their result instead of writing into their arguments, so a non-member
gets its first argument back unchanged (``x = jaxpg.all_reduce(x, group=g)`` keeps ``x``,
as torch's ``dist.all_reduce(x, group=g)`` does); calls that return nothing (``send``,
``barrier``) or a Work (``async_op=True``, ``isend``, ``irecv``) return None, as torch's.
The members of the group run it without that process, as in torch.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

from jaxpg.collectives.discarded import PASS_THROUGH
from jaxpg.groups.process_group import NON_GROUP_MEMBER

__all__ = ["skips_non_members", "warn_not_in_group"]

# jaxpg's name -> the op name torch's warning uses
_TORCH_OP = {"all_gather_into_tensor": "all_gather_single",
             "reduce_scatter_tensor": "reduce_scatter_single"}


def warn_not_in_group(api: str) -> None:
    """Warns as torch 2.13 does when a non-member calls ``api``."""
    from jaxpg.groups import world

    state = world.current(required=False)
    rank = -1 if state is None else state.acting_rank()
    warnings.warn(f"Running {_TORCH_OP.get(api, api)} on global rank {rank} which does not "
                  "belong to the given group.", UserWarning, stacklevel=3)


# calls whose torch form returns nothing or a Work: a non-member gets None, as in torch
_RETURN_NONE = frozenset({"send", "isend", "irecv", "barrier", "monitored_barrier"})


def skips_non_members(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a collective with a ``group`` argument: given ``NON_GROUP_MEMBER``, it warns
    and returns its first argument unchanged, or None (see the module doc); a
    micro-second-cheap identity check otherwise."""
    params = list(inspect.signature(fn).parameters)
    if "group" not in params:
        return fn
    index = params.index("group")
    api = fn.__name__
    first = None if api in _RETURN_NONE or index == 0 else params[0]
    async_index = params.index("async_op") if "async_op" in params else None

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        group = args[index] if len(args) > index else kwargs.get("group")
        if group is NON_GROUP_MEMBER:
            warn_not_in_group(api)
            if first is None:
                return None
            if async_index is not None and (args[async_index] if len(args) > async_index
                                            else kwargs.get("async_op")):
                return None  # torch's async form returns None too, not a Work
            return args[0] if args else kwargs.get(first)
        return fn(*args, **kwargs)

    PASS_THROUGH.add(wrapper.__code__)
    return wrapper
