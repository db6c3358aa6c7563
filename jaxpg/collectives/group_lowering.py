"""How one group's collectives lower onto the mesh of the running SPMD function.

A group (with its family of sibling subgroups) occupies some positions of the mesh. When
the family is exactly the partition made by a set of mesh axes (the world on its own mesh,
``DeviceMesh["dp"]``), every collective is the native ``lax`` op on those axes. Any other
group (``new_group([0, 3, 5])``, uneven enumerations) lowers to ``lax.ppermute`` rotations
within each subgroup, since ``axis_index_groups`` is not supported under ``shard_map``:
``k - 1`` rotations gather each subgroup's values in group-rank order, and the reduction
is then applied in that same order, so every member gets a bitwise-identical result.
Non-members get their input back unchanged.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpg.reduce_op import RedOpType, ReduceOp

__all__ = ["GroupLowering", "reduce_stack"]

# XLA's MPI collectives have no MPI datatype for these (MPI has no half or 8-bit floats):
# their reductions and gathers fail with "Unsupported primitive type". jaxpg gathers their
# bits as unsigned integers of the same width (exact) and reduces them in float32.
_NO_MPI_TYPE = {jnp.dtype(t) for t in ("float16", "float8_e4m3fn", "float8_e5m2")}


def reduce_stack(stack: jax.Array, op: ReduceOp, count: Any) -> jax.Array:
    """Reduces ``stack`` ([k, ...], group-rank order) over axis 0 with ``op``, in order.

    Args:
        stack: the gathered values.
        op: the reduction.
        count: the number of valid rows (a traced int for uneven families); rows past it
            are ignored.
    """
    k = stack.shape[0]
    valid = jnp.arange(k) < count
    kind = op.kind
    dtype = stack.dtype
    if kind is RedOpType.PREMUL_SUM:
        stack = stack * jnp.asarray(op.factor, dtype)
        kind = RedOpType.SUM
    if dtype == jnp.bool_:
        fn = {RedOpType.SUM: jnp.logical_or, RedOpType.MAX: jnp.logical_or,
              RedOpType.BOR: jnp.logical_or, RedOpType.BXOR: jnp.logical_xor,
              RedOpType.PRODUCT: jnp.logical_and, RedOpType.MIN: jnp.logical_and,
              RedOpType.BAND: jnp.logical_and}[kind]
    else:
        fn = {
            RedOpType.SUM: jnp.add, RedOpType.AVG: jnp.add, RedOpType.PRODUCT: jnp.multiply,
            RedOpType.MIN: jnp.minimum, RedOpType.MAX: jnp.maximum,
            RedOpType.BAND: jnp.bitwise_and, RedOpType.BOR: jnp.bitwise_or,
            RedOpType.BXOR: jnp.bitwise_xor,
        }[kind]
    all_valid = isinstance(count, int) and count == k
    acc = stack[0]
    for i in range(1, k):
        nxt = fn(acc, stack[i])
        acc = nxt if all_valid else jnp.where(valid[i], nxt, acc)
    if kind is RedOpType.AVG:
        acc = acc / jnp.asarray(count, dtype)
    return acc


class GroupLowering:
    """A group's positions on an SPMD mesh and its collectives there."""

    def __init__(self, ctx: Any, group: Any):
        self.ctx = ctx
        self.group = group
        missing = [r for r in group.members if r not in ctx.position_of_rank]
        if missing:
            raise ValueError(
                f"group {group.group_name!r} has ranks {missing} that are not on the mesh of "
                f"the running spmd function (ranks {sorted(ctx.position_of_rank)}); run the "
                "function over a group or mesh that holds every rank of this group."
            )
        self.subgroups = [[ctx.position_of_rank[r] for r in ranks] for ranks in group.family]
        self.sizes = [len(s) for s in self.subgroups]
        self.k = max(self.sizes)
        self.uniform = len(set(self.sizes)) == 1
        n = ctx.size
        member_index = np.full(n, -1, np.int32)
        size_of = np.ones(n, np.int32)
        for sub in self.subgroups:
            for j, pos in enumerate(sub):
                member_index[pos] = j
                size_of[pos] = len(sub)
        self._member_index = member_index
        self._size_of = size_of
        self.native_axes = self._find_native_axes()
        self._mpi = str(getattr(group._world, "backend", "")) == "mpi"

    def _mpi_bits(self, x: jax.Array) -> tuple[jax.Array, Any]:
        """backend="mpi": a dtype XLA's MPI cannot move, as same-width unsigned integers."""
        if not self._mpi or x.dtype not in _NO_MPI_TYPE:
            return x, None
        bits = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
        return lax.bitcast_convert_type(x, bits), x.dtype

    def _mpi_wide(self, x: jax.Array) -> tuple[jax.Array, Any]:
        """backend="mpi": a dtype XLA's MPI cannot reduce, widened to float32."""
        if not self._mpi or x.dtype not in _NO_MPI_TYPE:
            return x, None
        return x.astype(jnp.float32), x.dtype

    # ------------------------------------------------------------------- lowering facts
    def _find_native_axes(self) -> tuple[str, ...] | None:
        """The mesh axes whose partition is exactly this family, if any."""
        mesh_axes = self.ctx.axes
        shape = [self.ctx.mesh.shape[a] for a in mesh_axes]
        coords = list(itertools.product(*[range(s) for s in shape]))
        want = sorted(tuple(s) for s in self.subgroups)
        for r in range(1, len(mesh_axes) + 1):
            for chosen in itertools.combinations(range(len(mesh_axes)), r):
                parts: dict[tuple[int, ...], list[int]] = {}
                for pos, c in enumerate(coords):
                    other = tuple(c[i] for i in range(len(c)) if i not in chosen)
                    parts.setdefault(other, []).append(pos)
                if sorted(tuple(p) for p in parts.values()) == want:
                    return tuple(mesh_axes[i] for i in chosen)
        return None

    def member_index(self) -> jax.Array:
        """This rank's index within its subgroup (-1 for a non-member), traced."""
        return jnp.asarray(self._member_index)[self.ctx.position()]

    def subgroup_size(self) -> jax.Array:
        """The size of this rank's subgroup, traced (1 for a non-member)."""
        return jnp.asarray(self._size_of)[self.ctx.position()]

    def is_member(self) -> jax.Array:
        return self.member_index() >= 0

    def keep_for_nonmembers(self, result: Any, original: Any) -> Any:
        """Returns ``result`` on members and ``original`` on non-members."""
        if self.native_axes is not None:
            return result
        member = self.is_member()
        return jax.tree.map(lambda r, o: jnp.where(member, r, o), result, original)

    def _pairs(self, shift: int) -> list[tuple[int, int]]:
        pairs = []
        for sub in self.subgroups:
            k = len(sub)
            if shift % k:
                pairs += [(sub[j], sub[(j + shift) % k]) for j in range(k)]
        return pairs

    def _ppermute(self, x: jax.Array, pairs: list[tuple[int, int]]) -> jax.Array:
        if not pairs:
            return jnp.zeros_like(x)
        return lax.ppermute(x, self.ctx.axes, pairs)

    # ------------------------------------------------------------------------ collectives
    def gather(self, x: jax.Array) -> jax.Array:
        """Returns [k, *x.shape]: every member's ``x`` in group-rank order."""
        if self.native_axes is not None:
            bits, dtype = self._mpi_bits(x)
            out = lax.all_gather(bits, self.native_axes, axis=0, tiled=False)
            return out if dtype is None else lax.bitcast_convert_type(out, dtype)
        rotated = [x] + [self._ppermute(x, self._pairs(d)) for d in range(1, self.k)]
        stack = jnp.stack(rotated)  # stack[d] = value of member (j - d) mod size
        j = jnp.maximum(self.member_index(), 0)
        src = jnp.mod(j - jnp.arange(self.k), self.subgroup_size())
        return stack[src]

    def all_reduce(self, x: jax.Array, op: ReduceOp) -> jax.Array:
        axes = self.native_axes
        kind = op.kind
        if axes is not None and x.dtype != jnp.bool_:
            wide, dtype = self._mpi_wide(x)
            if dtype is not None and kind in (RedOpType.SUM, RedOpType.AVG, RedOpType.MIN,
                                              RedOpType.MAX, RedOpType.PREMUL_SUM):
                return self.all_reduce(wide, op).astype(dtype)
            if kind is RedOpType.SUM:
                return lax.psum(x, axes)
            if kind is RedOpType.AVG:
                return lax.psum(x, axes) / jnp.asarray(self.k, x.dtype)
            if kind is RedOpType.PREMUL_SUM:
                return lax.psum(x * jnp.asarray(op.factor, x.dtype), axes)
            if kind is RedOpType.MIN:
                return lax.pmin(x, axes)
            if kind is RedOpType.MAX:
                return lax.pmax(x, axes)
        count = self.k if self.uniform else self.subgroup_size()
        out = reduce_stack(self.gather(x), op, count)
        return self.keep_for_nonmembers(out, x)

    def reduce_scatter(self, x: jax.Array, op: ReduceOp) -> jax.Array:
        """``x`` is [k * c, ...]; member j gets the reduction of rows [j c, (j+1) c)."""
        axes = self.native_axes
        if axes is not None and x.dtype != jnp.bool_ and op.kind in (
            RedOpType.SUM, RedOpType.AVG, RedOpType.PREMUL_SUM
        ):
            wide, dtype = self._mpi_wide(x)
            if dtype is not None:
                return self.reduce_scatter(wide, op).astype(dtype)
            y = x * jnp.asarray(op.factor, x.dtype) if op.kind is RedOpType.PREMUL_SUM else x
            out = lax.psum_scatter(y, axes, scatter_dimension=0, tiled=True)
            return out / jnp.asarray(self.k, x.dtype) if op.kind is RedOpType.AVG else out
        full = self.all_reduce(x, op)
        c = x.shape[0] // self.k
        j = jnp.maximum(self.member_index(), 0)
        return lax.dynamic_slice_in_dim(full, j * c, c, axis=0)

    def all_to_all(self, x: jax.Array) -> jax.Array:
        """``x`` is [k, ...]; member j's row i goes to member i's row j."""
        if self.native_axes is not None:
            return lax.all_to_all(x, self.native_axes, 0, 0, tiled=True)
        j = jnp.maximum(self.member_index(), 0)
        size = self.subgroup_size()
        received = [x[j]]
        for d in range(1, self.k):
            chunk = x[jnp.mod(j + d, size)]
            received.append(self._ppermute(chunk, self._pairs(d)))
        stack = jnp.stack(received)  # stack[d] = row j of member (j - d) mod size
        src = jnp.mod(j - jnp.arange(self.k), size)
        return self.keep_for_nonmembers(stack[src], x)

    def broadcast(self, x: jax.Array, src: int) -> jax.Array:
        """Every member gets member ``src``'s ``x``."""
        if self.native_axes is not None:
            j = self.member_index()
            if x.dtype == jnp.bool_:
                return lax.psum(jnp.where(j == src, x, False).astype(jnp.int32),
                                self.native_axes).astype(jnp.bool_)
            bits, dtype = self._mpi_bits(x)
            if dtype is not None:  # adding zeros to the bits is exact
                return lax.bitcast_convert_type(
                    lax.psum(jnp.where(j == src, bits, jnp.zeros_like(bits)), self.native_axes),
                    dtype)
            return lax.psum(jnp.where(j == src, x, jnp.zeros_like(x)), self.native_axes)
        pairs = []
        for sub in self.subgroups:
            if src < len(sub):
                pairs += [(sub[src], sub[i]) for i in range(len(sub)) if i != src]
        out = x
        # ppermute needs a permutation, so a broadcast is one ppermute per receiver offset.
        for d in range(1, self.k):
            step = [(s, t) for s, t in pairs
                    if self._offset(s, t) == d]
            if step:
                moved = self._ppermute(x, step)
                recv_here = jnp.mod(self.member_index() - src, self.subgroup_size()) == d
                out = jnp.where(recv_here & self.is_member(), moved, out)
        return out

    def _offset(self, s: int, t: int) -> int:
        for sub in self.subgroups:
            if s in sub and t in sub:
                return (sub.index(t) - sub.index(s)) % len(sub)
        raise AssertionError((s, t))

    def permute(self, x: jax.Array, group_pairs: list[tuple[int, int]]) -> jax.Array:
        """Sends ``x`` from group rank ``a`` to ``b`` for each pair, in every subgroup.

        A rank that receives nothing gets zeros, as ``lax.ppermute``.
        """
        pairs = []
        for sub in self.subgroups:
            for a, b in group_pairs:
                if a < len(sub) and b < len(sub):
                    pairs.append((sub[a], sub[b]))
        return self._ppermute(x, pairs)
