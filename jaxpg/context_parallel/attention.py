"""``attention``: softmax attention over a sequence split across a context-parallel group.

Where it runs decides what ``q, k, v`` are:

* **SPMD code** binding the group's axis (``jaxpg.spmd(fn, group=cp)``, ``spmd(mesh=...)``
  or ``jax.shard_map`` over a mesh with a ``cp`` axis, DDP/FSDP steps): this rank's shards,
  ``(batch, seq_local, heads, head_dim)``; the result is this rank's output shard. This is
  how to train.
* **host code**: this process's local data. With every rank of the group in one process,
  the shards stacked along a new leading axis in group-rank order (``shard_sequence``'s
  output); differentiable. Across processes with one rank each, this process's own shard;
  forward only (differentiate inside SPMD code).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.context_parallel.gathered import all_gather_attention, all_to_all_attention
from jaxpg.context_parallel.ring import ring_attention
from jaxpg.groups import world as _world
from jaxpg.groups.mesh_axis import MeshAxis, resolve_mesh_axis
from jaxpg.spmd_lowering import current_context

__all__ = ["attention", "METHODS"]

METHODS = {"ring": ring_attention, "all_to_all": all_to_all_attention,
           "all_gather": all_gather_attention}
API = "context_parallel.attention"


def _check_inputs(q: Any, k: Any, v: Any, cp: int, method: str, load_balance: bool,
                  lead: int) -> None:
    """Argument checks on the per-rank shapes (``lead`` leading stacked axes skipped)."""
    if method not in METHODS:
        raise ValueError(f"{API}: method={method!r} is not one of {sorted(METHODS)}.")
    arrays = {"q": q, "k": k, "v": v}
    shapes = {name: tuple(jnp.shape(a))[lead:] for name, a in arrays.items()}
    for name, shape in shapes.items():
        if len(shape) != 4:
            raise ValueError(
                f"{API}: {name} has per-rank shape {shape}; expected 4 dimensions "
                "(batch, seq_local, heads, head_dim)"
                + (" after the leading stacked rank axis." if lead else "."))
        dtype = jnp.result_type(arrays[name])
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"{API}: {name} must be floating point; got dtype {dtype}.")
    q_shape, k_shape = shapes["q"], shapes["k"]
    if (shapes["k"] != shapes["v"] or q_shape[:2] != k_shape[:2] or q_shape[3] != k_shape[3]
            or q_shape[2] % k_shape[2]):
        raise ValueError(
            f"{API}: q, k and v must have the same per-rank shape (batch, seq_local, heads, "
            "head_dim), except that k and v may have fewer heads dividing q's (grouped-query "
            f"attention); got q {shapes['q']}, k {shapes['k']}, v {shapes['v']}.")
    _, seq_local, heads, _ = shapes["q"]
    if load_balance and seq_local % 2:
        raise ValueError(
            f"{API}: load_balance=True needs an even seq_local (the sequence split into "
            f"2 * cp = {2 * cp} chunks); got seq_local={seq_local}. Pad the sequence to a "
            f"multiple of {2 * cp} or pass load_balance=False.")
    if method == "all_to_all" and heads % cp:
        raise ValueError(
            f"{API}: method='all_to_all' splits the heads over the group, so heads must be "
            f"divisible by cp={cp}; got heads={heads}. Use method='ring' or 'all_gather'.")


def _spmd_attention(q, k, v, axis, n, scale, causal, method, load_balance):
    if n == 1:
        method = "all_gather"  # no communication: plain attention with the causal mask
    return METHODS[method](q, k, v, axis, n, scale, causal, load_balance)


def attention(q: Any, k: Any, v: Any, *, group: Any = None, causal: bool = False,
              method: str = "ring", scale: float | None = None,
              load_balance: bool | None = None) -> jax.Array:
    """Softmax attention of this rank's query shard to the whole sequence's keys.

    Equals ``softmax(q @ k.T * scale [+ causal mask]) @ v`` over the sequence gathered from
    the group, returned as this rank's shard, forward and backward.

    Args:
        q, k, v: this rank's shards ``(batch, seq_local, heads, head_dim)`` (host code in one
            process: stacked ``(cp, batch, seq_local, heads, head_dim)``), in the layout of
            :func:`~jaxpg.context_parallel.shard_sequence` with the same ``load_balance``.
            ``k`` and ``v`` may have fewer heads, dividing q's (grouped-query attention:
            query head ``h`` attends with key head ``h // (heads // kv_heads)``); the ring
            and the all-gather send them as they are.
        group: the context-parallel group: a ProcessGroup, ``mesh["cp"]``, or None (world).
        causal: mask keys at later global positions than the query.
        method: ``"ring"`` (K/V rotated by ``ppermute``), ``"all_to_all"`` (Ulysses) or
            ``"all_gather"``.
        scale: the score scale; ``1 / sqrt(head_dim)`` for None.
        load_balance: the shards use the ``2 * cp``-chunk layout (rank ``i`` holds chunks
            ``i`` and ``2 * cp - 1 - i``); None means ``causal``.

    Returns:
        This rank's output shard (host code: this process's local data), in ``q``'s dtype.

    Raises:
        ValueError: an unknown method, mismatched shapes, an odd ``seq_local`` with
            ``load_balance``, heads not divisible by cp for ``all_to_all``, a group that is
            not one mesh dimension, or shards of different lengths across processes.

    Example:
        >>> cp = jaxpg.init_device_mesh((4,), ("cp",))["cp"]
        >>> f = jaxpg.spmd(lambda q, k, v: attention(q, k, v, group=cp, causal=True),
        ...                group=cp)
    """
    cp = resolve_mesh_axis(group, "cp", api=API)
    load_balance = causal if load_balance is None else bool(load_balance)
    axis = cp.bound_axis(API)
    if axis is not None:
        _check_inputs(q, k, v, cp.size, method, load_balance, lead=0)
        d = jnp.shape(q)[-1]
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        return _spmd_attention(q, k, v, axis, cp.size, scale, causal, method, load_balance)
    if current_context() is not None:
        raise ValueError(
            f"{API}: called inside SPMD code that does not bind the context-parallel axis "
            f"{cp.axis!r} (size {cp.size}); run it under jaxpg.spmd(fn, group=cp_group) for a "
            "1-D group, or spmd(mesh=mesh, ...) / jax.shard_map over the mesh holding the "
            "cp axis.")
    return _host_attention(q, k, v, cp, causal, method, scale, load_balance)


def _group_mesh(cp: MeshAxis) -> tuple[Mesh, int, bool]:
    """The group's own 1-D mesh, its local rank count and whether data comes unstacked."""
    if cp.group is None:
        raise TypeError(f"{API}: from host code, pass group= as a ProcessGroup or mesh['cp'].")
    state = _world.current()
    mesh = Mesh(np.array(cp.group.devices, dtype=object), ("cp",))
    local = [r for r in cp.group.ranks if r in set(state.local_ranks)]
    unstacked = state.multiprocess and len(local) == 1
    return mesh, len(local), unstacked


@functools.lru_cache(maxsize=64)
def _kernel(mesh: Mesh, n: int, scale: float, causal: bool, method: str, load_balance: bool):
    def per_rank(q, k, v):
        o = _spmd_attention(q[0], k[0], v[0], "cp", n, scale, causal, method, load_balance)
        return o[None]

    return jax.shard_map(per_rank, mesh=mesh, in_specs=(P("cp"),) * 3, out_specs=P("cp"),
                         check_vma=False)


def _host_attention(q, k, v, cp, causal, method, scale, load_balance):
    mesh, n_local, unstacked = _group_mesh(cp)
    lead = 0 if unstacked else 1
    _check_inputs(q, k, v, cp.size, method, load_balance, lead=lead)
    if not unstacked and jnp.shape(q)[0] != n_local:
        raise ValueError(
            f"{API}: from host code q's leading axis must stack this process's {n_local} "
            f"ranks of the group (group-rank order); got shape {tuple(jnp.shape(q))}. Use "
            "shard_sequence(x, group) to lay the sequence out.")
    d = jnp.shape(q)[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    kernel = _kernel(mesh, cp.size, scale, causal, method, load_balance)
    if not _world.current().multiprocess:
        return kernel(q, k, v)
    if unstacked:
        _check_same_lengths(q, cp)
        q, k, v = (np.asarray(a)[None] for a in (q, k, v))
    sharding = NamedSharding(mesh, P("cp"))
    glob = [jax.make_array_from_process_local_data(
        sharding, np.asarray(a), (cp.size,) + tuple(np.shape(a))[1:]) for a in (q, k, v)]
    out = jax.jit(kernel)(*glob)
    shards = sorted(out.addressable_shards, key=lambda s: s.index[0].start)
    local = np.concatenate([np.asarray(s.data) for s in shards])
    return jnp.asarray(local[0] if unstacked else local)


def _check_same_lengths(q: Any, cp: MeshAxis) -> None:
    from jaxpg.collectives.objects import all_gather_object

    shapes = all_gather_object(list(np.shape(q)), group=cp.group)
    if any(tuple(s) != tuple(np.shape(q)) for s in shapes):
        raise ValueError(
            f"{API}: the processes of the group passed shards of different shapes "
            f"{[tuple(s) for s in shapes]} (group-rank order); every rank needs the same "
            "(batch, seq_local, heads, head_dim): split the sequence with shard_sequence.")
