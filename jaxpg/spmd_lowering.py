"""The SPMD lowering's context: ``jaxpg.spmd`` runs a function once per rank under shard_map.

While such a function is traced, collectives see the active :class:`SpmdContext` and lower
to ``lax`` collectives over its mesh axes; outside one, they take the eager (host) path.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpg.groups import world as _world
from jaxpg.groups.callbacks import set_traced_rank
from jaxpg.groups.resolve import resolve_group, resolve_mesh
from jaxpg.supervision.step_recording import recorded_step

__all__ = ["spmd", "SpmdContext", "current_context"]

_local = threading.local()


def current_context() -> SpmdContext | None:
    """Returns the innermost active SPMD context, or None in host code."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


class SpmdContext:
    """The mesh a function runs on per rank, and how global ranks map onto its positions.

    Positions number the mesh's devices row-major over ``axes``, which is the linear index
    ``lax.axis_index(axes)`` and ``lax.ppermute(..., axes)`` use.
    """

    def __init__(self, mesh: Mesh, world: Any, axes: tuple[str, ...] | None = None):
        self.mesh = mesh
        self.world = world
        self.axes = tuple(axes or mesh.axis_names)
        devices = np.asarray(mesh.devices).reshape(-1)
        self.rank_at_position = np.array([world.rank_of_device(d) for d in devices], np.int32)
        self.position_of_rank = {int(r): i for i, r in enumerate(self.rank_at_position)}
        self._lowerings: dict[int, Any] = {}

    def __enter__(self) -> SpmdContext:
        _local.__dict__.setdefault("stack", []).append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _local.stack.pop()

    @property
    def size(self) -> int:
        return len(self.rank_at_position)

    def position(self) -> jax.Array:
        """This rank's (traced) position."""
        return lax.axis_index(self.axes)

    def lowering(self, group: Any) -> Any:
        """Returns the :class:`GroupLowering` of ``group`` on this mesh (cached)."""
        from jaxpg.collectives.group_lowering import GroupLowering

        lay = self._lowerings.get(group.id)
        if lay is None:
            lay = GroupLowering(self, group)
            self._lowerings[group.id] = lay
        return lay

    def traced_group_rank(self, group: Any) -> jax.Array:
        """This rank's rank in ``group`` (-1 for non-members), traced."""
        table = np.array(
            [group.group_rank(int(r)) for r in self.rank_at_position], dtype=np.int32
        )
        return jnp.asarray(table)[self.position()]


def _traced_rank(group: Any) -> jax.Array | None:
    ctx = current_context()
    return None if ctx is None else ctx.traced_group_rank(group)


set_traced_rank(_traced_rank)  # get_rank (groups layer) asks through this inside SPMD code


def _stacked_specs(tree: Any, axis: str) -> Any:
    return jax.tree.map(lambda _: P(axis), tree)


def _recorded_from_host(mapped: Callable[..., Any], target: Any, fn: Any) -> Callable[..., Any]:
    """``mapped``, which, called from host code in a multi-process world, runs jitted as a
    recorded collective call on ``target``'s group (``jaxpg.supervision.recorded_step``:
    numbered, in the flight recorder, and a hang inside names the ranks at fault)."""
    name = f"spmd({getattr(fn, '__name__', None) or 'fn'})"
    step: list[Any] = []

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        state = _world.current(required=False)
        if state is None or not state.multiprocess:
            return mapped(*args)
        if not step:
            step.append(recorded_step(jax.jit(mapped), target, name=name))
        return step[0](*args)

    return call


def spmd(
    fn: Callable[..., Any] | None = None,
    *,
    group: Any = None,
    mesh: Any = None,
    in_specs: Any = None,
    out_specs: Any = None,
    check_vma: bool = False,
) -> Callable[..., Any]:
    """Runs ``fn`` once per rank under ``jax.shard_map``; collectives inside lower to lax ops.

    Two forms:

    * ``spmd(fn, group=g)`` (a ProcessGroup or a 1-D DeviceMesh; the world for None): every
      argument and result is a pytree whose leaves are stacked along a leading axis of size
      ``g.size()`` in group-rank order; ``fn`` sees one rank's slice (without the leading axis).
      A group with sibling subgroups (one dimension of a mesh, such as ``mesh["ep"]`` of a
      2-D mesh, or one of ``new_subgroups``') runs every sibling at once: the leading axis
      then has one row per rank of the family, in global-rank order (``g.members``).
    * ``spmd(fn, mesh=m, in_specs=..., out_specs=...)``: a thin wrapper over ``jax.shard_map``
      on a ``DeviceMesh``, ``ParallelDims``, ``HybridCommunicateGroup`` or
      ``jax.sharding.Mesh``; groups that are mesh axes (``m["dp"]``)
      lower to collectives on that axis name.

    Inside ``fn``, ``jaxpg.get_rank()`` is the traced global rank. The result composes with
    ``jax.jit`` and ``jax.grad``. Called from host code in a multi-process world it runs
    jitted as a recorded collective call on the group (the mesh's devices for ``mesh=``):
    numbered like an eager collective, in the flight recorder, and a hang inside raises a
    ``DistTimeoutError`` naming the ranks at fault (``jaxpg.supervision.recorded_step``).

    Example:
        >>> f = jaxpg.spmd(lambda x: jaxpg.all_reduce(x) * jaxpg.get_rank())
        >>> f(jnp.ones((8, 3)))[:, 0]   # 8 ranks
        Array([ 0.,  8., 16., 24., 32., 40., 48., 56.], dtype=float32)
    """
    if fn is None:
        return functools.partial(
            spmd, group=group, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
            check_vma=check_vma,
        )
    state = _world.current()
    if mesh is not None:
        if group is not None:
            raise ValueError("spmd: pass group= or mesh=, not both.")
        jax_mesh = resolve_mesh(mesh, api="spmd")
        if in_specs is None or out_specs is None:
            raise ValueError("spmd(mesh=...) needs in_specs and out_specs, as jax.shard_map.")

        def body(*args: Any) -> Any:
            with SpmdContext(jax_mesh, state):
                return fn(*args)

        return _recorded_from_host(jax.shard_map(
            body, mesh=jax_mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma
        ), jax_mesh, fn)

    pg = resolve_group(group, api="spmd")
    if len(pg.family) > 1:
        jax_mesh = pg.family_mesh
    else:
        jax_mesh = pg.jax_mesh
    axis = pg.axis_name

    def per_rank(*args: Any) -> Any:
        squeezed = jax.tree.map(lambda a: a[0], args)
        with SpmdContext(jax_mesh, state):
            out = fn(*squeezed)
        return jax.tree.map(lambda a: jnp.expand_dims(a, 0), out)

    def wrapped(*args: Any) -> Any:
        in_s = _stacked_specs(args, axis) if in_specs is None else in_specs
        out_s = out_specs if out_specs is not None else P(axis)
        return jax.shard_map(
            per_rank, mesh=jax_mesh, in_specs=in_s, out_specs=out_s, check_vma=check_vma
        )(*args)

    return _recorded_from_host(wrapped, pg, fn)
