"""The experts' grouped matmul: ``out[r] = lhs[r] @ rhs[e(r)]`` for rows grouped by expert.

``lhs`` is ``(m, k)`` with its rows in expert order, ``group_sizes[e]`` rows for expert
``e``; ``rhs`` is ``(E, k, n)``. Rows past ``sum(group_sizes)`` (the unused tail of a
worst-case buffer) come out zero, as in ``jax.lax.ragged_dot``. Three implementations:

* ``"xla"``: ``jax.lax.ragged_dot``. XLA:CPU and XLA:GPU compute every group over every
  row and mask, so it costs about ``E`` dense matmuls of all ``m`` rows.
* ``"tiled"``: a loop over row tiles of ``TILE_ROWS`` (megablox's plan, written in
  ``lax``): each step multiplies one tile by one expert's weights, and only tiles that hold
  routed rows are visited, so the cost follows the rows the experts really got (plus at
  most one partial tile per expert), not the buffer's size. Its VJP runs the same loop:
  ``d lhs`` against the transposed weights, ``d rhs[e]`` by accumulating ``tileᵀ · d out``.
* ``"mosaic"``: jax's Hopper kernels in Pallas/Mosaic GPU
  (``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`` forward and input gradient,
  ``transposed_ragged_dot_mgpu`` weight gradient). 16-bit inputs on compute capability 9.x.

``"auto"`` picks ``"tiled"`` on CPU, ``"mosaic"`` where it applies, else ``"xla"``. See
docs/expert_parallel.md for the measured costs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["GROUPED_MATMUL_IMPLS", "TILE_ROWS", "grouped_matmul", "resolve_grouped_matmul",
           "mosaic_applies", "pad_rows", "round_up", "tile_loop"]

GROUPED_MATMUL_IMPLS = ("auto", "xla", "tiled", "mosaic")
TILE_ROWS = 128  # rows per tile of the "tiled" loop: a matmul large enough to run at speed

# Mosaic GPU block sizes: the best of those measured on an H100 (bench/results/ragged_dot_gpu.json).
_MOSAIC_BLOCKS = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4,
                      grid_block_n=1)


def check_grouped_matmul(impl: Any, api: str) -> str:
    """Checks the ``grouped_matmul`` argument; returns it."""
    if not isinstance(impl, str) or impl not in GROUPED_MATMUL_IMPLS:
        raise ValueError(f"{api}: grouped_matmul={impl!r} must be one of "
                         f"{', '.join(map(repr, GROUPED_MATMUL_IMPLS))}.")
    return impl


def mosaic_applies(lhs: Any, rhs: Any, backend: str | None = None) -> str | None:
    """Why the Mosaic GPU kernels cannot run these operands; None when they can."""
    backend = backend or jax.default_backend()
    if backend != "gpu":
        return f"the default backend is {backend!r}, not 'gpu'"
    capability = getattr(jax.devices("gpu")[0], "compute_capability", "")
    if not str(capability).startswith("9."):
        return f"the GPU's compute capability is {capability!r}; the kernels need 9.x (Hopper)"
    dtypes = {jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype)}
    if len(dtypes) != 1 or jnp.dtype(lhs.dtype).itemsize != 2:
        return f"the operands are {lhs.dtype} and {rhs.dtype}; the kernels need one 16-bit dtype"
    k, n = rhs.shape[1:]
    if k % 128 or n % 128:  # the kernels' blocks (block_m, block_n, block_k) must tile them
        return f"the experts' widths ({k}, {n}) must be multiples of 128 for the kernels"
    return None


def resolve_grouped_matmul(impl: str, lhs: Any, rhs: Any) -> str:
    """The implementation ``impl`` names for these operands (``"auto"`` resolved).

    Raises:
        ValueError: ``"mosaic"`` asked for where it cannot run, with the reason.
    """
    if impl == "auto":
        if jax.default_backend() == "cpu":
            return "tiled"
        return "mosaic" if mosaic_applies(lhs, rhs) is None else "xla"
    if impl == "mosaic" and (why_not := mosaic_applies(lhs, rhs)) is not None:
        raise ValueError(f"grouped_matmul='mosaic' cannot run here: {why_not}. Use 'auto'.")
    return impl


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   impl: str = "auto") -> jax.Array:
    """``(m, k) x (E, k, n) -> (m, n)``: each row times its group's matrix.

    Args:
        lhs: ``(m, k)`` rows grouped in expert order.
        rhs: ``(E, k, n)`` one matrix per group.
        group_sizes: ``(E,)`` int32 rows per group; rows past their sum come out zero.
        impl: ``"auto"``, ``"xla"``, ``"tiled"`` or ``"mosaic"`` (module docstring).

    Returns:
        ``(m, n)`` in ``lhs``'s dtype promoted with ``rhs``'s.
    """
    impl = resolve_grouped_matmul(check_grouped_matmul(impl, "grouped_matmul"), lhs, rhs)
    if impl == "xla":
        return lax.ragged_dot(lhs, rhs, group_sizes)
    if impl == "tiled":
        return _tiled(lhs, rhs, group_sizes.astype(jnp.int32))
    return _mosaic(lhs, rhs, group_sizes.astype(jnp.int32))


# ---- "tiled": a loop over the tiles that hold routed rows ----------------------------------

def _work_items(group_sizes: jax.Array, num_tiles: int) -> tuple[jax.Array, ...]:
    """The (tile, group) pairs to multiply, in order, and how many there are.

    A group covers tiles ``start // T`` to ``ceil(end / T) − 1``; tiles shared by two groups
    appear once per group. There are at most ``num_tiles + E − 1`` of them.
    """
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    first = starts // TILE_ROWS
    tiles = jnp.where(group_sizes > 0, (ends + TILE_ROWS - 1) // TILE_ROWS - first, 0)
    last_item = jnp.cumsum(tiles)  # inclusive: items of groups 0..e
    bound = num_tiles + group_sizes.shape[0] - 1
    item = jnp.arange(bound, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(last_item, item, side="right"),
                        group_sizes.shape[0] - 1).astype(jnp.int32)
    tile = jnp.take(first, group) + item - jnp.take(last_item - tiles, group)
    return last_item[-1], group, tile, starts, ends


def round_up(m: int, block: int) -> int:
    """``m`` rounded up to whole blocks."""
    return -(-m // block) * block


def pad_rows(a: jax.Array, rows: int) -> jax.Array:
    """``a`` with zero rows appended up to ``rows``."""
    return a if a.shape[0] == rows else jnp.pad(a, ((0, rows - a.shape[0]), (0, 0)))


def tile_loop(body: Any, init: Any, group_sizes: jax.Array, m: int) -> Any:
    """Runs ``body(group, row0, mask, carry)`` over the work items (the tiles holding a
    group's rows; ``mask`` marks them in the tile); returns the carry. The tiled matmul and
    the fused MLP (:mod:`.grouped_mlp`) both run on it."""
    num_tiles = round_up(m, TILE_ROWS) // TILE_ROWS
    count, group, tile, starts, ends = _work_items(group_sizes, num_tiles)
    offsets = jnp.arange(TILE_ROWS, dtype=jnp.int32)

    def step(i: jax.Array, carry: Any) -> Any:
        e = group[i]
        row0 = tile[i] * TILE_ROWS
        rows = row0 + offsets
        mask = (rows >= starts[e]) & (rows < ends[e])
        return body(e, row0, mask[:, None], carry)

    return lax.fori_loop(0, count, step, init)


def _tiled_forward(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                   transpose_rhs: bool) -> jax.Array:
    """``lhs[r] @ rhs[e(r)]`` (``rhs[e]ᵀ`` when ``transpose_rhs``)."""
    m = lhs.shape[0]
    padded = round_up(m, TILE_ROWS)
    lhs_p = pad_rows(lhs, padded)
    out_dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))

    def body(e: jax.Array, row0: jax.Array, mask: jax.Array, out: jax.Array) -> jax.Array:
        tile = lax.dynamic_slice_in_dim(lhs_p, row0, TILE_ROWS)
        w = lax.dynamic_index_in_dim(rhs, e, keepdims=False)
        prod = lax.dot_general(tile, w, (contract, ((), ())),
                               preferred_element_type=jnp.float32).astype(out_dtype)
        cur = lax.dynamic_slice_in_dim(out, row0, TILE_ROWS)
        return lax.dynamic_update_slice_in_dim(out, cur + jnp.where(mask, prod, 0), row0, 0)

    out = tile_loop(body, jnp.zeros((padded, n), out_dtype), group_sizes, m)
    return out[:m]


def _tiled_weight_grad(lhs: jax.Array, d_out: jax.Array, group_sizes: jax.Array,
                       num_groups: int, dtype: Any) -> jax.Array:
    """``d rhs[e] = lhs[rows of e]ᵀ · d_out[rows of e]``: ``(E, k, n)``."""
    m = lhs.shape[0]
    padded = round_up(m, TILE_ROWS)
    lhs_p, d_out_p = pad_rows(lhs, padded), pad_rows(d_out, padded)

    def body(e: jax.Array, row0: jax.Array, mask: jax.Array, grad: jax.Array) -> jax.Array:
        tile = jnp.where(mask, lax.dynamic_slice_in_dim(lhs_p, row0, TILE_ROWS), 0)
        d_tile = lax.dynamic_slice_in_dim(d_out_p, row0, TILE_ROWS)
        part = lax.dot_general(tile, d_tile, (((0,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)
        cur = lax.dynamic_index_in_dim(grad, e, keepdims=False)
        return lax.dynamic_update_index_in_dim(grad, cur + part, e, 0)

    shape = (num_groups, lhs.shape[1], d_out.shape[1])
    grad = tile_loop(body, jnp.zeros(shape, jnp.float32), group_sizes, m)
    return grad.astype(dtype)


def _with_vjp(ragged: Any, weight_grad: Any) -> Any:
    """The grouped matmul ``ragged(lhs, rhs, group_sizes, transpose_rhs)`` as a
    differentiable function of ``(lhs, rhs, group_sizes)``: the rows' gradient is ``ragged``
    against the transposed matrices, the matrices' is
    ``weight_grad(lhs, d_out, group_sizes, num_groups, dtype)``."""

    @jax.custom_vjp
    def fn(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return ragged(lhs, rhs, group_sizes, False)

    def fwd(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> Any:
        return fn(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

    def bwd(res: Any, d_out: jax.Array) -> tuple[Any, Any, None]:
        lhs, rhs, group_sizes = res
        d_out = d_out.astype(lhs.dtype)
        d_lhs = ragged(d_out, rhs, group_sizes, True).astype(lhs.dtype)
        return d_lhs, weight_grad(lhs, d_out, group_sizes, rhs.shape[0], rhs.dtype), None

    fn.defvjp(fwd, bwd)
    return fn


_tiled = _with_vjp(_tiled_forward, _tiled_weight_grad)


# ---- "mosaic": jax's Hopper kernels ---------------------------------------------------------

def _mosaic_ragged(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                   transpose_rhs: bool) -> jax.Array:
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    m = lhs.shape[0]
    out = ragged_dot_mgpu.ragged_dot(pad_rows(lhs, _mosaic_rows(m)), rhs,
                                     group_sizes=group_sizes, transpose_rhs=transpose_rhs,
                                     **_MOSAIC_BLOCKS)[:m]
    used = jnp.arange(m) < jnp.sum(group_sizes)  # the kernel leaves the tail
    return jnp.where(used[:, None], out, 0).astype(lhs.dtype)


def _mosaic_rows(m: int) -> int:
    """Rows padded to whole blocks: the kernels' memory tiling needs it (zero rows, unused)."""
    return round_up(m, _MOSAIC_BLOCKS["block_m"])


def _mosaic_weight_grad(lhs: jax.Array, d_out: jax.Array, group_sizes: jax.Array,
                        num_groups: int, dtype: Any) -> jax.Array:
    """``d rhs[e] = lhs[rows of e]ᵀ · d_out[rows of e]`` by the transposed kernel."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    rows = _mosaic_rows(lhs.shape[0])
    grad = transposed_ragged_dot_mgpu.transposed_ragged_dot(
        pad_rows(lhs, rows), pad_rows(d_out, rows), group_sizes=group_sizes,
        **_MOSAIC_BLOCKS)
    return grad.astype(dtype)


_mosaic = _with_vjp(_mosaic_ragged, _mosaic_weight_grad)
