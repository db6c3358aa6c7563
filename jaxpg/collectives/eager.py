"""The eager (host) lowering: this process's data in, a cached SPMD kernel, its part out.

A process passes the data of its own ranks of the group (of the group's family): a plain
array when it holds one such rank (torch's model), or the ranks' arrays stacked along a
leading axis in rank order when it holds several (a notebook with 8 devices). The data
becomes a global array over the family's mesh, a jitted ``shard_map`` kernel runs the same
code the SPMD lowering runs, and the process gets back its ranks' results in the same form.
Kernels are compiled once per (group, op, static arguments, shapes, dtypes) and cached.

With one rank here (the *flat* path) the kernel takes and returns per-rank arrays: the call
costs one device dispatch, the kernel, and no copy in or out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg._jax_compat import array_from_single_block
from jaxpg.collectives._dispatch import NARROW_64
from jaxpg.groups.callbacks import on_reset
from jaxpg.reduce_op import ReduceOp
from jaxpg.spmd_lowering import SpmdContext
from jaxpg.supervision import signature_check

__all__ = ["run_eager", "local_count", "holds_every_member", "clear_kernel_cache"]

_kernels: dict[tuple, Callable[..., Any]] = {}
# flat (one rank here) kernel key -> (kernel, fingerprint, family size, input shardings)
_flat: dict[tuple, tuple[Callable[..., Any], tuple, int, list[NamedSharding]]] = {}
# group.id -> (ranks of the family held here, whether that is all of them, input sharding,
# this process's first device): fixed for a group's lifetime, and computed once so a small
# eager call costs little.
_plans: dict[int, tuple[int, bool, NamedSharding, Any]] = {}
# Set by ``p2p`` while this process has point-to-point work outstanding: called with the
# api before each collective across processes, it completes this process's earlier sends.
before_collective: list[Callable[[str], None]] = []


def _subgroup_max(group: Any) -> Callable[[Any], Any]:
    """The signature check's reduction: the maximum over this rank's own subgroup of the
    family, lowered as the group's collectives are (``jaxpg.collectives.group_lowering``)."""
    mesh, state = group.family_mesh, group._world

    def maximum(x: Any) -> Any:
        with SpmdContext(mesh, state) as ctx:
            return ctx.lowering(group).all_reduce(x, ReduceOp.MAX)

    return maximum


signature_check.group_max[:] = [_subgroup_max]


@on_reset
def clear_kernel_cache() -> None:
    """Forgets every compiled eager kernel (``destroy_process_group`` calls it)."""
    _kernels.clear()
    _plans.clear()
    _flat.clear()


def _plan(group: Any, api: str) -> tuple[int, bool, NamedSharding, Any]:
    plan = _plans.get(group.id)
    if plan is None:
        local, members = group.local_members(), group.members
        if not local:
            raise ValueError(
                f"{api}: this process holds no rank of group {group.group_name!r} "
                f"(ranks {list(members)}); only members may call it, as in torch."
            )
        sharding = NamedSharding(group.family_mesh, P(group.axis_name))
        device = group._world.devices[local[0]]  # the one device of a one-rank process
        plan = _plans[group.id] = (len(local), len(local) == len(members), sharding, device)
    return plan


def local_count(group: Any, api: str) -> int:
    """Returns how many ranks of ``group``'s family this process holds (raises if none)."""
    return _plan(group, api)[0]


def holds_every_member(group: Any, api: str) -> bool:
    """Returns True if this process holds every rank of ``group``'s family (raises if none)."""
    return _plan(group, api)[1]


def _as_stacked(x: Any, n_local: int, api: str, arg: str) -> Any:
    arr = x if isinstance(x, jax.Array) else _host(x, api)
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
        if arr.sharding is sharding or arr.sharding == sharding:
            return arr
    elif all_local and isinstance(arr, np.ndarray):
        return arr  # the kernel's in_shardings put it on the devices, cheaper than device_put
    if all_local:
        return jax.device_put(arr, sharding)
    shape = (len(group.members), *arr.shape[1:])
    if isinstance(arr, jax.Array):  # split on the devices: no host round trip, no waiting
        devices = [group._world.devices[r] for r in group.local_members()]
        local = NamedSharding(Mesh(np.array(devices, dtype=object), ("local",)), P("local"))
        parts = jax.device_put(arr, local).addressable_shards
        return jax.make_array_from_single_device_arrays(shape, sharding, [s.data for s in parts])
    return jax.make_array_from_process_local_data(sharding, np.asarray(arr), shape)


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


def _global_from_block(shape: tuple, sharding: NamedSharding, block: jax.Array) -> jax.Array:
    """The global array whose one addressable block is ``block``: no copy, no dispatch."""
    return array_from_single_block(shape, sharding, block)


def _host(x: Any, api: str = "collective") -> np.ndarray:
    """A host input as numpy, in the dtypes JAX's x64 setting allows (float64 -> float32
    unless x64, as ``jnp.asarray``); the op's ``check_input`` has warned or raised already."""
    arr = np.asarray(x)
    narrow = NARROW_64.get(arr.dtype)
    if narrow is None or jax.config.jax_enable_x64:
        return arr
    return arr.astype(narrow)


def _compile_flat(group: Any, api: str, static_key: Any, body: Callable[..., Any],
                  names: tuple, sig: tuple) -> tuple:
    """The per-rank kernel: rank ``i``'s input is block ``i`` of dim 0 of a global array (a
    0-d input is passed as a replicated 0-d array whose local value is the rank's), and its
    outputs come back the same way, so the call needs no reshape on either side."""
    mesh, axis, state = group.family_mesh, group.axis_name, group._world
    k = len(group.members)
    in_specs = tuple(P() if len(shape) == 0 else P(axis) for shape, _ in sig)

    def per_rank(*blocks: Any) -> Any:
        with SpmdContext(mesh, state) as ctx:
            return body(ctx.lowering(group), **dict(zip(names, blocks)))

    def probe(*blocks: Any) -> Any:  # which outputs are 0-d decides their out_specs
        return jax.tree.map(lambda a: a[None], per_rank(*blocks))

    avals = [jax.ShapeDtypeStruct(shape if not shape else (k * shape[0], *shape[1:]), dtype)
             for shape, dtype in sig]
    shapes = jax.eval_shape(jax.shard_map(probe, mesh=mesh, in_specs=in_specs,
                                          out_specs=P(axis), check_vma=False), *avals)
    out_specs = jax.tree.map(lambda a: P() if a.ndim == 1 else P(axis), shapes)
    kernel = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=in_specs,
                                   out_specs=out_specs, check_vma=False))
    fingerprint = (api, static_key,
                   tuple((n, tuple(shape), str(dtype)) for n, (shape, dtype) in zip(names, sig)))
    return kernel, fingerprint, k, [NamedSharding(mesh, spec) for spec in in_specs]


def _run_flat(group: Any, api: str, static_key: Any, body: Callable[..., Any],
              inputs: dict[str, Any], sharding: NamedSharding, dev: Any,
              before: Callable[[], None] | None = None) -> Any:
    """One rank of the group here: the kernel takes and returns per-rank arrays.

    This rank's array is block ``i`` of a ``[k * m, ...]`` global array built around its
    buffer (no copy, no dispatch; with ``k = 1`` the array itself), and its result is the
    kernel's one addressable block. Returns ``NotImplemented`` for an input spread over
    several devices (the stacked path takes it).
    """
    names = tuple(inputs) if len(inputs) == 1 else tuple(sorted(inputs))
    blocks = []
    for name in names:
        v = inputs[name]
        if isinstance(v, jax.Array):
            devs = v.sharding.device_set
            if len(devs) != 1:
                return NotImplemented
            if dev not in devs:
                v = jax.device_put(v, dev)
        else:
            v = jax.device_put(_host(v, api), dev)
        blocks.append(v)
    sig = tuple((v.shape, v.dtype) for v in blocks)
    key = (group.id, api, static_key, names, sig)
    entry = _flat.get(key)
    if entry is None:
        entry = _flat[key] = _compile_flat(group, api, static_key, body, names, sig)
    kernel, fingerprint, k, in_shardings = entry
    if k > 1:
        blocks = [_global_from_block((k * b.shape[0], *b.shape[1:]) if b.shape else (), sh, b)
                  for b, sh in zip(blocks, in_shardings)]
    out = _call(group, api, kernel, blocks, fingerprint, before)
    if k == 1:
        return out
    if isinstance(out, jax.Array):
        return out.addressable_shards[0].data
    return jax.tree.map(lambda o: o.addressable_shards[0].data, out)


def _call(group: Any, api: str, kernel: Callable[..., Any], args: Any,
          fingerprint: Any = None, before: Callable[[], None] | None = None) -> Any:
    """Runs the kernel; across processes, as the group's next collective (progress marks,
    fingerprints, the backend's blocking or stream-ordered semantics). ``args`` is a list,
    or a function that builds it (run where the kernel is dispatched)."""
    if not group._world.multiprocess:
        return kernel(*(args() if callable(args) else args))
    if before_collective:
        before_collective[0](api)
    from jaxpg.groups import multiprocess

    if before is not None:  # runs where the kernel is dispatched, inside the call's timeout
        inner = kernel

        def kernel(*a: Any) -> Any:
            before()
            return inner(*a)

    if callable(args):
        return multiprocess.run_collective(group, api, lambda: kernel(*args()), fingerprint)
    return multiprocess.run_collective(group, api, lambda: kernel(*args), fingerprint)


def run_eager(
    group: Any,
    api: str,
    static_key: Any,
    body: Callable[..., Any],
    inputs: dict[str, Any],
    before: Callable[[], None] | None = None,
) -> Any:
    """Runs ``body(layout, **per_rank_inputs)`` on every rank of ``group``'s family.

    Args:
        group: the ProcessGroup.
        api: the collective's name, for errors and the cache key.
        static_key: hashable static arguments that change the kernel (op, src, ...).
        body: traced per rank; returns a pytree of per-rank arrays.
        inputs: this process's data by argument name (plain or stacked, see module doc).
        before: across processes, run just before the kernel, as part of the call (inside
            its timeout and flight record): ``barrier``'s check-in.

    Returns:
        The pytree ``body`` returns, with this process's ranks' parts (plain or stacked).
    """
    n_local, all_local, sharding, device = _plan(group, api)
    if n_local == 1:
        out = _run_flat(group, api, static_key, body, inputs, sharding, device, before)
        if out is not NotImplemented:
            return out
    state = group._world
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
                out = body(ctx.lowering(group), **{k: a[0] for k, a in zip(names, args)})
            return jax.tree.map(lambda a: jnp.expand_dims(a, 0), out)

        kernel = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P(axis),
                                       out_specs=P(axis), check_vma=False),
                         in_shardings=sharding)
        _kernels[key] = kernel
    if state.multiprocess:
        fingerprint = (api, static_key,
                       tuple((n, shape, str(dtype)) for n, (shape, dtype) in zip(names, sig)))
        out = _call(group, api, kernel,
                    lambda: [_to_global(a, group, sharding, all_local) for a in stacked],
                    fingerprint, before)
    else:
        out = kernel(*[_to_global(a, group, sharding, all_local) for a in stacked])
    if isinstance(out, jax.Array):
        return _local_part(out, group, n_local, all_local)
    return jax.tree.map(lambda o: _local_part(o, group, n_local, all_local), out)
