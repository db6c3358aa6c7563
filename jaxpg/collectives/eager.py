"""The eager (host) lowering: this process's data in, a cached SPMD kernel, its part out.

A process passes the data of its own ranks of the group (of the group's family): a plain
array when it holds one such rank (torch's model), or the ranks' arrays stacked along a
leading axis in rank order when it holds several (a notebook with 8 devices). The data
becomes a global array over the family's mesh, a jitted ``shard_map`` kernel runs the same
code the SPMD lowering runs, and the process gets back its ranks' results in the same form.
Kernels are compiled once per (group, op, static arguments, shapes, dtypes) and cached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.groups.callbacks import on_reset
from jaxpg.spmd import SpmdContext

__all__ = ["run_eager", "local_count", "holds_every_member", "clear_kernel_cache"]

_kernels: dict[tuple, Callable[..., Any]] = {}
# group.id -> (ranks of the family held here, whether that is all of them, input sharding):
# fixed for a group's lifetime, and computed once so a small eager call costs little.
_plans: dict[int, tuple[int, bool, NamedSharding]] = {}
# flat kernel key -> which of its outputs are 0-d (recorded while the kernel is traced)
_flat_scalars: dict[tuple, list[bool]] = {}


@on_reset
def clear_kernel_cache() -> None:
    """Forgets every compiled eager kernel (``destroy_process_group`` calls it)."""
    _kernels.clear()
    _plans.clear()
    _flat_scalars.clear()


def _plan(group: Any, api: str) -> tuple[int, bool, NamedSharding]:
    plan = _plans.get(group.id)
    if plan is None:
        local, members = group.local_members(), group.members
        if not local:
            raise ValueError(
                f"{api}: this process holds no rank of group {group.group_name!r} "
                f"(ranks {list(members)}); only members may call it, as in torch."
            )
        sharding = NamedSharding(group.family_mesh, P(group.axis_name))
        plan = _plans[group.id] = (len(local), len(local) == len(members), sharding)
    return plan


def local_count(group: Any, api: str) -> int:
    """Returns how many ranks of ``group``'s family this process holds (raises if none)."""
    return _plan(group, api)[0]


def holds_every_member(group: Any, api: str) -> bool:
    """Returns True if this process holds every rank of ``group``'s family (raises if none)."""
    return _plan(group, api)[1]


def _as_stacked(x: Any, n_local: int, api: str, arg: str) -> Any:
    if isinstance(x, jax.Array):
        arr = x
    else:
        arr = np.asarray(x)
        if arr.dtype == np.float64 and not jax.config.jax_enable_x64:
            arr = arr.astype(np.float32)
        elif arr.dtype == np.int64 and not jax.config.jax_enable_x64:
            arr = arr.astype(np.int32)
    if n_local == 1:
        return arr[None]
    if arr.ndim == 0 or arr.shape[0] != n_local:
        raise ValueError(
            f"{api}: this process holds {n_local} ranks of the group, so {arg} must stack "
            f"their data along a leading axis of size {n_local}; got shape {tuple(arr.shape)}."
        )
    return arr


def _to_global(arr: Any, group: Any, sharding: NamedSharding, all_local: bool) -> Any:
    if isinstance(arr, jax.Array):
        if arr.sharding == sharding:
            return arr
    elif all_local and isinstance(arr, np.ndarray):
        return arr  # the kernel's in_shardings put it on the devices, cheaper than device_put
    if all_local:
        return jax.device_put(arr, sharding)
    return jax.make_array_from_process_local_data(sharding, np.asarray(arr),
                                                  (len(group.members), *arr.shape[1:]))


def _local_part(out: jax.Array, group: Any, n_local: int, all_local: bool) -> Any:
    if all_local:
        return out[0] if n_local == 1 else out
    shards = sorted(out.addressable_shards, key=lambda s: s.index[0].start)
    if n_local == 1:
        return shards[0].data[0]
    devices = [s.device for s in shards]
    mesh = Mesh(np.array(devices, dtype=object), ("local",))
    return jax.make_array_from_single_device_arrays(
        (n_local, *out.shape[1:]), NamedSharding(mesh, P("local")), [s.data for s in shards]
    )


def _run_flat(group: Any, api: str, static_key: Any, body: Callable[..., Any],
              inputs: dict[str, Any], sharding: NamedSharding) -> Any:
    """One rank here, the others in other processes: no copies in or out.

    This rank's data is block ``i`` of a ``[k * m, ...]`` global array (``x`` itself when it
    is a one-device array: ``make_array_from_single_device_arrays`` copies nothing), and its
    result is the kernel's one addressable shard. The stacked form would add a leading axis
    on the way in and index it away on the way out: two full copies per call. Returns
    ``NotImplemented`` for 0-d inputs and multi-device arrays (the stacked path takes them).
    """
    names = tuple(sorted(inputs))
    vals = [inputs[k] for k in names]
    if any(np.ndim(v) == 0 or (isinstance(v, jax.Array) and len(v.sharding.device_set) != 1)
           for v in vals):
        return NotImplemented
    state, k = group._world, len(group.members)
    dev = next(iter(sharding.addressable_devices))
    args = []
    for name, v in zip(names, vals):
        if isinstance(v, jax.Array):
            v = v if v.sharding.device_set == {dev} else jax.device_put(v, dev)
            args.append(jax.make_array_from_single_device_arrays(
                (k * v.shape[0], *v.shape[1:]), sharding, [v]))
        else:
            v = _as_stacked(v, 1, api, name)[0]  # numpy, dtype as the stacked path
            args.append(jax.make_array_from_process_local_data(
                sharding, v, (k * v.shape[0], *v.shape[1:])))
    key = (group.id, api, static_key, names,
           tuple((tuple(a.shape[1:]), a.dtype) for a in args), "flat")
    kernel = _kernels.get(key)
    if kernel is None:
        mesh, axis = group.family_mesh, group.axis_name

        def per_rank(*blocks: Any) -> Any:
            with SpmdContext(mesh, state) as ctx:
                out = body(ctx.layout(group), **dict(zip(names, blocks)))
            leaves, tree = jax.tree.flatten(out)
            _flat_scalars[key] = [a.ndim == 0 for a in leaves]  # set while tracing
            return jax.tree.unflatten(tree, [a[None] if a.ndim == 0 else a for a in leaves])

        kernel = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P(axis),
                                       out_specs=P(axis), check_vma=False))
        _kernels[key] = kernel
    out = _call(group, api, kernel, args)
    leaves, tree = jax.tree.flatten(out)
    parts = [o.addressable_shards[0].data for o in leaves]
    parts = [p[0] if s else p for p, s in zip(parts, _flat_scalars[key])]
    return jax.tree.unflatten(tree, parts)


def _call(group: Any, api: str, kernel: Callable[..., Any], args: list[Any]) -> Any:
    """Runs the kernel; across processes, with progress marks and the group's timeout."""
    if not group._world.multiprocess:
        return kernel(*args)
    from jaxpg.groups import multiprocess

    return multiprocess.run_collective(group, api, lambda: kernel(*args))


def run_eager(
    group: Any,
    api: str,
    static_key: Any,
    body: Callable[..., Any],
    inputs: dict[str, Any],
) -> Any:
    """Runs ``body(layout, **per_rank_inputs)`` on every rank of ``group``'s family.

    Args:
        group: the ProcessGroup.
        api: the collective's name, for errors and the cache key.
        static_key: hashable static arguments that change the kernel (op, src, ...).
        body: traced per rank; returns a pytree of per-rank arrays.
        inputs: this process's data by argument name (plain or stacked, see module doc).

    Returns:
        The pytree ``body`` returns, with this process's ranks' parts (plain or stacked).
    """
    n_local, all_local, sharding = _plan(group, api)
    state = group._world
    if state.multiprocess and n_local == 1 and not all_local:
        out = _run_flat(group, api, static_key, body, inputs, sharding)
        if out is not NotImplemented:
            return out
    names = tuple(sorted(inputs))
    stacked = [_as_stacked(inputs[k], n_local, api, k) for k in names]
    sig = tuple((tuple(a.shape[1:]), a.dtype) for a in stacked)
    key = (group.id, api, static_key, names, sig)
    kernel = _kernels.get(key)
    if kernel is None:
        axis = group.axis_name
        mesh = group.family_mesh

        def per_rank(*args: Any) -> Any:
            with SpmdContext(mesh, state) as ctx:
                out = body(ctx.layout(group), **{k: a[0] for k, a in zip(names, args)})
            return jax.tree.map(lambda a: jnp.expand_dims(a, 0), out)

        kernel = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P(axis),
                                       out_specs=P(axis), check_vma=False),
                         in_shardings=sharding)
        _kernels[key] = kernel
    out = _call(group, api, kernel, [_to_global(a, group, sharding, all_local) for a in stacked])
    if isinstance(out, jax.Array):
        return _local_part(out, group, n_local, all_local)
    return jax.tree.map(lambda o: _local_part(o, group, n_local, all_local), out)
