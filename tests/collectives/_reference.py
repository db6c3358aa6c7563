"""Naive references: numpy over every rank's input, and the group kinds the tests use."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import jaxpg
from jaxpg import RedOpType, ReduceOp

WORLD = 8
DTYPES = ["float32", "bfloat16", "int32", "bool"]


def all_ops() -> list[ReduceOp]:
    return [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND,
            ReduceOp.BOR, ReduceOp.BXOR, ReduceOp.AVG, ReduceOp.PREMUL_SUM(0.5)]


def valid(op: ReduceOp, dtype: str) -> bool:
    if op.kind in (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR):
        return dtype in ("int32", "bool")
    if op.kind in (RedOpType.AVG, RedOpType.PREMUL_SUM):
        return dtype in ("float32", "bfloat16")
    return True


def np_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def rank_data(shape: tuple[int, ...], dtype: str, seed: int = 0) -> np.ndarray:
    """[WORLD, *shape] inputs, small values so products and bf16 sums stay exact-ish."""
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.random((WORLD, *shape)) > 0.5
    if dtype == "int32":
        return rng.integers(-3, 4, (WORLD, *shape)).astype(np.int32)
    vals = rng.integers(-4, 5, (WORLD, *shape)).astype(np.float32) / 2
    vals[vals == 0] = 0.5
    return vals.astype(np_dtype(dtype))


def np_reduce(op: ReduceOp, rows: list[np.ndarray]) -> np.ndarray:
    """Reduces in group-rank order with numpy, computing floats in float32."""
    dt = rows[0].dtype
    is_bool = dt == np.bool_
    work = [r.astype(np.float32) if dt.kind == "V" or str(dt) == "bfloat16" else r for r in rows]
    kind = op.kind
    if kind is RedOpType.PREMUL_SUM:
        work = [w * np.float32(op.factor) for w in work]
        kind = RedOpType.SUM
    if is_bool:
        fn = {RedOpType.SUM: np.logical_or, RedOpType.MAX: np.logical_or,
              RedOpType.BOR: np.logical_or, RedOpType.BXOR: np.logical_xor,
              RedOpType.PRODUCT: np.logical_and, RedOpType.MIN: np.logical_and,
              RedOpType.BAND: np.logical_and}[kind]
    else:
        fn = {RedOpType.SUM: np.add, RedOpType.AVG: np.add, RedOpType.PRODUCT: np.multiply,
              RedOpType.MIN: np.minimum, RedOpType.MAX: np.maximum,
              RedOpType.BAND: np.bitwise_and, RedOpType.BOR: np.bitwise_or,
              RedOpType.BXOR: np.bitwise_xor}[kind]
    out = functools.reduce(fn, work)
    if kind is RedOpType.AVG:
        out = out / len(rows)
    return np.asarray(out)


GROUP_KINDS = ["world", "mesh_axis", "subset", "enumeration"]
UNEVEN_KINDS = [*GROUP_KINDS, "uneven"]
"""The group kinds with uneven subgroups ([0, 1, 2] and [3, ..., 7]), for the collectives
whose result is defined per subgroup whatever its size."""


def make_group(kind: str):
    """Returns (group, family): the group to pass and its family's rank lists."""
    if kind == "world":
        return None, [list(range(WORLD))]
    if kind == "mesh_axis":
        mesh = jaxpg.init_device_mesh((2, 4), ("dp", "pp"))
        g = mesh.get_group("dp")
        return g, [list(r) for r in g.family]
    if kind == "subset":
        g = jaxpg.new_group([0, 3, 5])
        return g, [[0, 3, 5]]
    if kind == "enumeration":
        cur, subs = jaxpg.new_subgroups_by_enumeration([[1, 2, 6, 7], [0, 3, 4, 5]])
        return cur, [list(s.ranks) for s in subs]
    if kind == "uneven":  # subgroups of different sizes: AVG must divide by each one's own
        cur, subs = jaxpg.new_subgroups_by_enumeration([[0, 1, 2], [3, 4, 5, 6, 7]])
        return cur, [list(s.ranks) for s in subs]
    raise AssertionError(kind)


def members(family: list[list[int]]) -> list[int]:
    return sorted(r for sub in family for r in sub)


def assert_close(got, want, dtype: str) -> None:
    got = np.asarray(got)
    want = np.asarray(want)
    if dtype in ("bfloat16",):
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32),
                                   rtol=2e-2, atol=2e-2)
    elif dtype == "float32":
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    else:
        np.testing.assert_array_equal(got, want)


def per_rank(lowering: str, fn: Callable, x: np.ndarray, family: list[list[int]]) -> dict:
    """Runs ``fn`` per rank and returns global rank -> its output (numpy leaves).

    ``lowering='eager'``: one eager call on the family's members' rows of ``x`` (leading
    axis = the members, in rank order); ``'spmd'``: ``jaxpg.spmd(fn)`` jitted over the
    whole world's ``x``.
    """
    mem = members(family)
    if lowering == "eager":
        out = jax.device_get(fn(x[mem]))
        return {r: jax.tree.map(lambda a, i=i: np.asarray(a)[i], out) for i, r in enumerate(mem)}
    out = jax.device_get(jax.jit(jaxpg.spmd(fn))(x))
    return {r: jax.tree.map(lambda a, r=r: np.asarray(a)[r], out) for r in range(WORLD)}


def assert_non_members_keep_input(got: dict[int, Any], x: np.ndarray,
                                  family: list[list[int]], dtype: str) -> None:
    """In SPMD every rank runs the collective; ranks outside the group get their input."""
    for r in set(range(WORLD)) - set(members(family)):
        assert_close(got[r], x[r], dtype)
