"""Object collectives: all_gather_object, broadcast_object_list, gather_object and
scatter_object_list.

Objects travel as bytes in uint8 arrays through the array collectives. They are encoded
with msgpack (NumPy arrays included), which cannot run code when decoded; tuples come back
as lists. ``allow_pickle=True`` uses pickle instead, for any Python object: never do that
with peers you do not trust, since unpickling runs arbitrary code.

In a process holding several ranks of the group, every local rank contributes the same
object unless it is wrapped in ``PerRank([...])`` (one per local rank).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import jax
import msgpack
import numpy as np

from jaxpg.collectives._dispatch import group_rank_of, resolve, torch_form_error
from jaxpg.collectives.discarded import warns_if_discarded
from jaxpg.collectives.gathers import all_gather

__all__ = [
    "PerRank",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
]


class PerRank(tuple):
    """One object per local rank of the group, in rank order (several ranks per process)."""


_NDARRAY = 1


def _default(obj: Any) -> Any:
    if isinstance(obj, (np.ndarray, jax.Array, np.generic)):
        arr = np.asarray(obj)
        return msgpack.ExtType(_NDARRAY, msgpack.packb(
            [arr.dtype.str, list(arr.shape), arr.tobytes()], use_bin_type=True))
    raise TypeError(
        f"object collectives: {type(obj).__name__} cannot be sent with msgpack; send plain "
        "data (numbers, strings, bytes, lists, dicts, arrays) or pass allow_pickle=True "
        "(unsafe with untrusted peers)."
    )


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _NDARRAY:
        dtype, shape, raw = msgpack.unpackb(data, raw=False)
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    return msgpack.ExtType(code, data)


def encode_object(obj: Any, allow_pickle: bool) -> np.ndarray:
    """Returns ``obj`` as a uint8 array."""
    if allow_pickle:
        raw = b"P" + pickle.dumps(obj)
    else:
        raw = b"M" + msgpack.packb(obj, default=_default, use_bin_type=True)
    return np.frombuffer(raw, np.uint8)


def decode_object(data: Any, allow_pickle: bool) -> Any:
    """Inverse of :func:`encode_object`; refuses pickle unless ``allow_pickle``."""
    raw = np.asarray(data, np.uint8).tobytes()
    if raw[:1] == b"P":
        if not allow_pickle:
            raise ValueError(
                "object collectives: a peer sent a pickled object, and unpickling runs "
                "arbitrary code; pass allow_pickle=True only if you trust every peer."
            )
        return pickle.loads(raw[1:])  # noqa: S301 (explicit opt-in)
    return msgpack.unpackb(raw[1:], ext_hook=_ext_hook, raw=False, strict_map_key=False)


def _local_objects(pg: Any, obj: Any, api: str) -> list[Any]:
    n_local = len(pg.local_members())
    if isinstance(obj, PerRank):
        if len(obj) != n_local:
            raise ValueError(f"{api}: PerRank holds {len(obj)} objects; this process holds "
                             f"{n_local} ranks of the group.")
        return list(obj)
    return [obj] * max(n_local, 1)


def _gather_bytes(pg: Any, objs: list[Any], allow_pickle: bool, api: str) -> list[Any]:
    encoded = [encode_object(o, allow_pickle) for o in objs]
    parts = all_gather(tuple(encoded), group=pg)
    rows = [p if len(encoded) == 1 else p[0] for p in parts]
    return [decode_object(jax.device_get(r), allow_pickle) for r in rows]


def all_gather_object(obj: Any, group: Any = None, *, allow_pickle: bool = False) -> list[Any]:
    """Gathers every rank's picklable object; **returns** the list in group-rank order
    (torch's ``all_gather_object(object_list, obj)`` fills ``object_list``)."""
    api = "all_gather_object"
    from jaxpg.groups.process_group import NON_GROUP_MEMBER, ProcessGroup

    if group is not None and group is not NON_GROUP_MEMBER and not isinstance(group,
                                                                               ProcessGroup):
        raise torch_form_error(api)  # anything in the group's place is torch's obj
    pg, _ = resolve(group, api)
    return _gather_bytes(pg, _local_objects(pg, obj, api), allow_pickle, api)


def gather_object(obj: Any, dst: int | None = None, group: Any = None, *,
                  group_dst: int | None = None, allow_pickle: bool = False) -> list[Any] | None:
    """Gathers every rank's object onto ``dst``: the list there, None elsewhere."""
    api = "gather_object"
    pg, _ = resolve(group, api)
    d = group_rank_of(pg, dst, group_dst, api, "dst")
    out = _gather_bytes(pg, _local_objects(pg, obj, api), allow_pickle, api)
    return out if pg.ranks[d] in pg._world.local_ranks else None


@warns_if_discarded
def broadcast_object_list(object_list: Sequence[Any], src: int | None = None, group: Any = None,
                          *, group_src: int | None = None,
                          allow_pickle: bool = False) -> list[Any]:
    """**Returns** ``src``'s ``object_list`` on every rank (torch fills the list in place:
    ``object_list = jaxpg.broadcast_object_list(object_list, src=0)`` here)."""
    api = "broadcast_object_list"
    pg, _ = resolve(group, api)
    s = group_rank_of(pg, src, group_src, api, "src")
    holds_src = pg.ranks[s] in pg._world.local_ranks
    payload = list(object_list) if holds_src else None
    gathered = _gather_bytes(pg, [payload] * len(pg.local_members()), allow_pickle, api)
    result = gathered[s]
    if len(result) != len(object_list):
        raise ValueError(f"{api}: object_list has {len(object_list)} entries here but "
                         f"{len(result)} on src={pg.ranks[s]}; they must match, as in torch.")
    return result


def scatter_object_list(scatter_object_input_list: Sequence[Any] | None = None,
                        src: int | None = None, group: Any = None, *,
                        group_src: int | None = None, allow_pickle: bool = False) -> Any:
    """Rank ``i`` gets ``scatter_object_input_list[i]`` from ``src``; returns it.

    A process holding several ranks gets a list, one object per local rank. Off ``src`` the
    input list is ignored (None or any list, as in torch).
    """
    api = "scatter_object_list"
    pg, _ = resolve(group, api)
    s = group_rank_of(pg, src, group_src, api, "src")
    holds_src = pg.ranks[s] in pg._world.local_ranks
    if holds_src and scatter_object_input_list is None:
        raise ValueError(
            f"{api}: scatter_object_input_list must be given on src={pg.ranks[s]}; this "
            f"process holds ranks {pg.local_members()}."
        )
    if holds_src and len(scatter_object_input_list) != pg.size():
        raise ValueError(f"{api}: scatter_object_input_list has "
                         f"{len(scatter_object_input_list)} objects; the group has "
                         f"{pg.size()} ranks.")
    payload = list(scatter_object_input_list) if holds_src else None
    gathered = _gather_bytes(pg, [payload] * len(pg.local_members()), allow_pickle, api)
    full = gathered[s]
    mine = [full[pg.group_rank(r)] for r in pg.local_members()]
    return mine[0] if len(mine) == 1 else mine
