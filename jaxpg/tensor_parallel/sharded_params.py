"""Tensor-parallel parameters: global arrays of the full shape, sharded over the tp axis.

**The representation** (what DDP, FSDP and the pipeline rely on): a tensor-parallel
parameter is an ``nnx.Param`` whose value is a global ``jax.Array`` of the *unsharded*
shape, laid out ``NamedSharding(mesh, spec)`` on the topology's mesh (:class:`MeshAxis`),
where ``spec`` names the tp axis on the split dimension (``P(None, "tp")`` for a
column-parallel kernel) and nothing else, so it is replicated over every other axis. Each
device holds exactly its shard; in a run with one rank per process, each process holds only
its own. Inside SPMD code (``shard_map`` with ``in_specs`` from :func:`param_specs`) a
layer sees its local shard. A later sharding over another axis (FSDP over ``"dp"``) adds
that axis to the spec of the same array.

* :func:`init_sharded` runs an initializer under ``jit`` with the sharded output layout:
  JAX's partitionable threefry makes every shard equal to the matching slice of the
  unsharded initialisation, and each device computes only its own shard.
* :func:`distribute_tensor` lays out a full tensor (torch's ``distribute_tensor``), by
  default taking tp rank 0's values (``src_data_rank=0``).
* :func:`param_specs` reads the ``PartitionSpec`` of every leaf of a state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.groups.mesh_axis import MeshAxis, resolve_mesh_axis

__all__ = ["init_sharded", "distribute_tensor", "param_specs", "local_shape", "check_divisible"]


def check_divisible(size: int, tp: MeshAxis, what: str, api: str) -> None:
    """Raises a ValueError unless ``tp.size`` divides ``size``; ``what`` names the dimension."""
    if size % tp.size:
        raise ValueError(
            f"{api}: tp_size={tp.size} must divide {what}={size}; choose a size that is a "
            f"multiple of {tp.size} or a tensor-parallel degree that divides {size}."
        )


def init_sharded(init: Callable[..., Any], key: jax.Array, shape: tuple[int, ...], dtype: Any,
                 sharding: NamedSharding) -> jax.Array:
    """``init(key, shape, dtype)`` laid out by ``sharding``, each device computing its shard."""
    impl = jax.random.key_impl(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else None
    raw = np.asarray(jax.random.key_data(key) if impl is not None else key)

    def make(raw_key):
        k = jax.random.wrap_key_data(raw_key, impl=impl) if impl is not None else raw_key
        return init(k, shape, dtype)

    return jax.jit(make, out_shardings=sharding)(raw)


def distribute_tensor(full: Any, tp: Any, spec: P, *, src_data_rank: int | None = 0
                      ) -> jax.Array:
    """Lays out the full tensor ``full`` as a global array ``NamedSharding(mesh, spec)``.

    Args:
        full: this process's copy of the whole tensor.
        tp: the tensor-parallel group, in any form a layer's ``mp_group`` takes (a 1-D
            ``DeviceMesh`` such as ``mesh["tp"]``, a ``ProcessGroup``, a topology); its
            arrays live on the topology's whole mesh.
        spec: the layout (the tp axis on the split dimension, if any).
        src_data_rank: 0 (torch's default): every rank takes its shard of the copy held by
            tp rank 0 of its replica (a scatter, so copies that differ across processes
            still give one consistent tensor); None: each rank slices its own copy.

    Returns:
        A fresh global array (never an alias of ``full``).
    """
    tp = resolve_mesh_axis(tp, "tp", api="distribute_tensor", arg="tp")
    if src_data_rank is not None and not 0 <= src_data_rank < tp.size:
        raise ValueError(f"distribute_tensor: src_data_rank={src_data_rank} is not a rank of "
                         f"the tensor-parallel group of size {tp.size}; pass 0..{tp.size - 1} "
                         "or None.")
    if isinstance(full, jax.Array) and jnp.issubdtype(full.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(full)
        data = distribute_tensor(jax.random.key_data(full), tp, spec, src_data_rank=src_data_rank)
        return jax.random.wrap_key_data(data, impl=impl)
    full = np.asarray(full) if not isinstance(full, jax.Array) else full
    sharding = NamedSharding(tp.mesh, spec)
    if jax.process_count() == 1:
        return jax.device_put(jnp.array(full, copy=True), sharding)
    host = np.asarray(full)
    if src_data_rank is None:
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return _scatter_from_rank(host, tp, spec, src_data_rank)


def _scatter_from_rank(host: np.ndarray, tp: MeshAxis, spec: P, src: int) -> jax.Array:
    """Every rank's shard of tp rank ``src``'s copy (one all-to-all or broadcast)."""
    axis, n = tp.axis, tp.size
    split_dim = next((d for d, e in enumerate(spec) if e == axis), None)
    coords = _local_coords(tp)
    stacked_sharding = NamedSharding(tp.mesh, P(axis))
    local = np.broadcast_to(host[None], (len(coords), *host.shape))
    stacked = jax.make_array_from_process_local_data(stacked_sharding, local,
                                                     (n, *host.shape))

    def body(x):
        x = x[0]
        if split_dim is None:  # replicated over tp: a broadcast from src
            mine = lax.axis_index(axis) == src
            return lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), axis)
        chunks = jnp.stack(jnp.split(x, n, axis=split_dim))
        received = lax.all_to_all(chunks, axis, 0, 0, tiled=False)  # [i]: rank i's chunk
        return received[src]

    fn = jax.shard_map(body, mesh=tp.mesh, in_specs=P(axis), out_specs=spec, check_vma=False)
    return jax.jit(fn, out_shardings=NamedSharding(tp.mesh, spec))(stacked)


def _local_coords(tp: MeshAxis) -> list[int]:
    """The distinct tp coordinates of this process's devices on the mesh."""
    devices = np.asarray(tp.mesh.devices)
    index = tp.mesh.axis_names.index(tp.axis)
    local = {d.id for d in jax.local_devices()}
    return sorted({int(c[index]) for c in np.argwhere(
        np.vectorize(lambda d: d.id in local)(devices))})


def param_specs(tree: Any) -> Any:
    """The ``PartitionSpec`` of every array leaf of ``tree`` (``P()`` if not a NamedSharding).

    Use it as ``in_specs``/``out_specs`` of a ``shard_map`` over the tensor-parallel mesh,
    so that tensor-parallel layers inside see their local shards.

    Example:
        >>> state = nnx.state(model)
        >>> f = jax.shard_map(step, mesh=mesh, in_specs=(param_specs(state), P()), ...)
    """
    def spec(x):
        sharding = getattr(x, "sharding", None)
        return sharding.spec if isinstance(sharding, NamedSharding) else P()

    return jax.tree.map(spec, tree)


def local_shape(shape: tuple[int, ...], spec: P, mesh: Any) -> tuple[int, ...]:
    """The per-device shape of a global ``shape`` laid out ``spec`` on ``mesh``."""
    out = list(shape)
    for d, entry in enumerate(spec):
        for a in (entry if isinstance(entry, tuple) else (entry,)) if entry is not None else ():
            out[d] //= mesh.shape[a]
    return tuple(out)
