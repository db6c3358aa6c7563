"""Every torch.distributed collective, in an SPMD and an eager lowering."""

from jaxpg.collectives.all_to_all import all_to_all, all_to_all_single
from jaxpg.collectives.barrier import barrier, monitored_barrier
from jaxpg.collectives.gathers import (
    all_gather,
    all_gather_into_tensor,
    all_gather_single,
    broadcast,
    gather,
    scatter,
)
from jaxpg.collectives.non_member import skips_non_members
from jaxpg.collectives.objects import (
    PerRank,
    all_gather_object,
    broadcast_object_list,
    gather_object,
    scatter_object_list,
)
from jaxpg.collectives.p2p import P2POp, batch_isend_irecv, irecv, isend, permute, recv, send
from jaxpg.collectives.reductions import (
    all_reduce,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
)
from jaxpg.collectives.work import Work

__all__ = [
    "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "all_gather",
    "all_gather_into_tensor", "all_gather_single", "broadcast", "gather", "scatter", "PerRank",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "P2POp", "batch_isend_irecv", "irecv", "isend", "permute", "recv", "send", "all_reduce",
    "reduce", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "Work",
]

# torch 2.13: a process outside the group warns and returns without communicating
_wrapped: dict[int, object] = {}  # aliases (reduce_scatter_single) share one wrapper
for _name in __all__:
    _fn = globals()[_name]
    if callable(_fn) and not isinstance(_fn, type):
        globals()[_name] = _wrapped.setdefault(id(_fn), skips_non_members(_fn))
del _name, _fn, _wrapped
