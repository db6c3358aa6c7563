"""PowerSGD gradient compression as a DDP communication hook.

This follows torch's ``powerSGD_hook`` in
``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``
(Vogels et al., 2019, https://arxiv.org/abs/1905.13727). Per bucket and step:

1. Before ``start_powerSGD_iter`` steps, plain allreduce (``psum(buffer / n)``).
2. Afterwards, with error feedback, add last step's local error to the buffer
   and keep a copy ``M0`` of the result.
3. View each gradient as an ``n x m`` matrix (``shape[0] x rest``); with
   ``r = min(n, m, matrix_approximation_rank)`` it is compressed when
   ``(n + m) * r * min_compression_rate < n * m``. Vectors (biases) never pass
   this test; they and the other uncompressed gradients are summed as one flat
   buffer and divided by the world size.
4. For each compressed matrix ``M``: take ``Q`` (fresh standard normal values on
   the first compressed step, or always without ``warm_start``; last step's
   ``Q`` otherwise), orthogonalise it, ``P = M Q``, sum all ``P`` of the bucket
   over the axis, orthogonalise ``P``, ``Q = M^T P``, sum all ``Q`` and divide
   by the world size, and replace ``M`` by ``P Q^T``.
5. The new local error is ``M0 - output`` over the whole bucket (torch's
   ``input_tensor_cp - input_tensor``; for the uncompressed gradients it is the
   local minus the mean, which averages to zero over the ranks).
6. The step counter advances after the step's last bucket.

Differences from torch, all deliberate:

- The state is a :class:`PowerSGDState` ``NamedTuple`` pytree (step counter,
  per-bucket error buffers, per-bucket ``Q`` memory) that the hook returns
  instead of mutating, so it can be carried through ``jit`` and checkpointed.
  Error buffers are per rank; carry the state with a leading rank axis
  (``PartitionSpec(axis)``) like any per-rank hook state.
- Random ``Q`` comes from ``jax.random`` keyed by ``random_seed``, the step and
  the bucket index (identical on every rank), not from ``torch.randn``.
- Orthogonalisation is always torch's Gram-Schmidt; torch switches to QR for
  float32 with rank > 2, which differs only in column signs that cancel in
  ``P Q^T``.
- ``start_powerSGD_iter`` may be 0 or 1: torch forbids that with error
  feedback or warm start only because DDP rebuilds its buckets after the
  first step, and jaxpg's buckets never change.
- With ``orthogonalization_epsilon=0`` an all-zero column gives NaN, as in
  torch; set a small epsilon such as ``1e-8`` if a bucket can be all zeros.

As in torch, single-pass Gram-Schmidt is inexact when a summed ``P`` has lower
rank than ``matrix_approximation_rank`` (e.g. a rank-1 gradient with ``r=2``):
the extra columns are rounding noise. Real gradients are rarely that degenerate.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxpg.ddp._axis import axis_size, to_varying
from jaxpg.ddp._flat import concat_1d
from jaxpg.ddp.grad_bucket import GradBucket

_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True, kw_only=True)
class PowerSGDConfig:
    """PowerSGD hyperparameters (torch's ``PowerSGDState`` constructor arguments).

    Attributes:
        matrix_approximation_rank: rank ``r`` of the ``P Q^T`` approximation.
        start_powerSGD_iter: number of steps of plain allreduce before compressing.
        min_compression_rate: compress a matrix only if it saves more than this factor.
        use_error_feedback: add each step's compression error to the next step's gradient.
        warm_start: reuse last step's ``Q`` instead of drawing a new random one.
        orthogonalization_epsilon: added to column norms in Gram-Schmidt.
        random_seed: seed of the random ``Q`` matrices (same on every rank).
    """

    matrix_approximation_rank: int = 1
    start_powerSGD_iter: int = 1000
    min_compression_rate: float = 2
    use_error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0
    random_seed: int = 0

    def __post_init__(self):
        for name in ("matrix_approximation_rank", "start_powerSGD_iter", "random_seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"PowerSGDConfig {name}={value!r} must be an int.")
        if self.matrix_approximation_rank < 1:
            raise ValueError(
                f"PowerSGDConfig matrix_approximation_rank={self.matrix_approximation_rank} "
                "must be at least 1."
            )
        if self.start_powerSGD_iter < 0:
            raise ValueError(
                f"PowerSGDConfig start_powerSGD_iter={self.start_powerSGD_iter} must be >= 0."
            )
        for name in ("min_compression_rate", "orthogonalization_epsilon"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"PowerSGDConfig {name}={value!r} must be a number >= 0.")


class PowerSGDState(NamedTuple):
    """PowerSGD's per-rank state, a pytree.

    Attributes:
        iteration: int32 scalar, the number of steps done so far.
        errors: per bucket, the 1-D local error buffer (``()`` without error feedback).
        q_memory: per bucket, the flat concatenation of the compressed
            matrices' ``Q`` (``()`` without warm start).
    """

    iteration: jax.Array
    errors: tuple[jax.Array, ...]
    q_memory: tuple[jax.Array, ...]


class _Matrix(NamedTuple):
    compress: bool
    rows: int
    cols: int
    rank: int


def _layout(shapes: tuple[tuple[int, ...], ...], config: PowerSGDConfig) -> list[_Matrix]:
    """Which gradients of a bucket compress, as torch's ``_should_compress`` decides."""
    out = []
    for shape in shapes:
        if len(shape) == 0:
            out.append(_Matrix(False, 1, 1, 1))
            continue
        n, m = shape[0], math.prod(shape[1:])
        r = min(n, m, config.matrix_approximation_rank)
        compress = (n + m) * r * config.min_compression_rate < n * m
        out.append(_Matrix(compress, n, m, r))
    return out


def init_powerSGD_state(plan: Any, config: PowerSGDConfig = PowerSGDConfig()) -> PowerSGDState:
    """The initial (per-rank) PowerSGD state for a :class:`~jaxpg.ddp.BucketPlan`."""
    errors, q_memory = [], []
    for bucket in plan.buckets:
        if config.use_error_feedback:
            errors.append(jnp.zeros((bucket.numel,), bucket.dtype))
        if config.warm_start:
            q_size = sum(x.cols * x.rank for x in _layout(bucket.shapes, config) if x.compress)
            q_memory.append(jnp.zeros((q_size,), bucket.dtype))
    return PowerSGDState(jnp.zeros((), jnp.int32), tuple(errors), tuple(q_memory))


def powerSGD_compression_stats(
    plan: Any, config: PowerSGDConfig = PowerSGDConfig()
) -> tuple[float, int, int]:
    """``(rate, numel before, numel after)`` of one compressed step (torch's stats)."""
    before = after = 0
    for bucket in plan.buckets:
        for x in _layout(bucket.shapes, config):
            before += x.rows * x.cols
            after += (x.rows + x.cols) * x.rank if x.compress else x.rows * x.cols
    return (before / after if after else 0.0), before, after


def orthogonalize(matrix: jax.Array, epsilon: float = 0) -> jax.Array:
    """Gram-Schmidt on the columns of a 2-D matrix, in torch's order of operations."""
    num_cols = matrix.shape[1]
    for i in range(num_cols):
        col = matrix[:, i : i + 1]
        norm = jnp.sqrt(jnp.sum(col * col))
        col = col / norm if epsilon == 0 else col / (norm + epsilon)
        matrix = matrix.at[:, i : i + 1].set(col)
        if i + 1 < num_cols:
            rest = matrix[:, i + 1 :]
            rest = rest - jnp.sum(col * rest, axis=0, keepdims=True) * col
            matrix = matrix.at[:, i + 1 :].set(rest)
    return matrix


def _split(flat: jax.Array, shapes: list[tuple[int, int]]) -> list[jax.Array]:
    out, offset = [], 0
    for rows, cols in shapes:
        out.append(flat[offset : offset + rows * cols].reshape(rows, cols))
        offset += rows * cols
    return out


def _concat(arrays: list[jax.Array], dtype: Any) -> jax.Array:
    return concat_1d(arrays, dtype)


def _low_rank(matrices, state, index, config, q_shapes, world_size, axis, dtype):
    """Step 4 of the module docstring; returns the approximations and the flat new Q."""
    key = jax.random.fold_in(jax.random.key(config.random_seed), state.iteration)
    keys = jax.random.split(jax.random.fold_in(key, index), len(q_shapes))
    qs = [
        jax.random.normal(k, s, jnp.float32).astype(dtype)
        for k, s in zip(keys, q_shapes, strict=True)
    ]
    if config.warm_start:
        first = state.iteration == config.start_powerSGD_iter
        previous = _split(state.q_memory[index], q_shapes)
        qs = [jnp.where(first, q, prev) for q, prev in zip(qs, previous, strict=True)]
    qs = [orthogonalize(q, config.orthogonalization_epsilon) for q in qs]

    ps = [jnp.matmul(m, q, precision=_HIGHEST) for m, q in zip(matrices, qs, strict=True)]
    # Like torch, all P (then all Q) of a bucket are summed in one all-reduce;
    # P is not divided by the world size because it is orthogonalised next.
    ps = _split(jax.lax.psum(_concat(ps, dtype), axis), [p.shape for p in ps])
    ps = [orthogonalize(p, config.orthogonalization_epsilon) for p in ps]
    qs = [jnp.matmul(m.T, p, precision=_HIGHEST) for m, p in zip(matrices, ps, strict=True)]
    q_flat = jax.lax.psum(_concat(qs, dtype), axis) / jnp.asarray(world_size, dtype)
    qs = _split(q_flat, q_shapes)
    return [jnp.matmul(p, q.T, precision=_HIGHEST) for p, q in zip(ps, qs, strict=True)], q_flat


def _compress_step(state, bucket, config, layout, world_size):
    axis, buffer, index = bucket.axis_name, bucket.buffer, bucket.index
    dtype = buffer.dtype
    if config.use_error_feedback:
        buffer = buffer + state.errors[index]
    grads = bucket.gradients(buffer)
    plain = [g for g, x in zip(grads, layout, strict=True) if not x.compress]
    matrices = [g.reshape(x.rows, x.cols) for g, x in zip(grads, layout, strict=True) if x.compress]
    q_shapes = [(x.cols, x.rank) for x in layout if x.compress]

    uncompressed = _concat(plain, dtype)
    if plain:  # torch: sum, then divide by the world size
        uncompressed = jax.lax.psum(uncompressed, axis) / jnp.asarray(world_size, dtype)
    approx, q_flat = [], jnp.zeros((0,), dtype)
    if matrices:
        approx, q_flat = _low_rank(
            matrices, state, index, config, q_shapes, world_size, axis, dtype
        )

    pieces, a_iter, u_offset = [], iter(approx), 0
    for g, x in zip(grads, layout, strict=True):
        if x.compress:
            pieces.append(next(a_iter).reshape(-1))
        else:
            pieces.append(uncompressed[u_offset : u_offset + g.size])
            u_offset += g.size
    out = _concat(pieces, dtype)
    errors = state.errors
    if config.use_error_feedback:
        errors = errors[:index] + (buffer - out,) + errors[index + 1 :]
    q_memory = state.q_memory
    if config.warm_start:
        q_memory = q_memory[:index] + (q_flat,) + q_memory[index + 1 :]
    return out, errors, q_memory


def _check_state(state: Any, bucket: GradBucket, config: PowerSGDConfig) -> None:
    if not isinstance(state, PowerSGDState):
        raise TypeError(
            f"powerSGD_hook needs a PowerSGDState, got {type(state).__name__}; build it with "
            "init_powerSGD_state(plan, config) (or the init_state_fn of make_comm_hook)."
        )
    expected = [(config.use_error_feedback, state.errors), (config.warm_start, state.q_memory)]
    for enabled, buffers in expected:
        if enabled and (bucket.index >= len(buffers) or buffers[bucket.index].ndim != 1):
            raise ValueError(
                f"The PowerSGDState has no buffer for bucket {bucket.index}; it was made for a "
                "different BucketPlan or PowerSGDConfig. Rebuild it with init_powerSGD_state."
            )
    if config.use_error_feedback and state.errors[bucket.index].shape != bucket.buffer.shape:
        raise ValueError(
            f"PowerSGDState error buffer of bucket {bucket.index} has shape "
            f"{state.errors[bucket.index].shape}, the bucket {bucket.buffer.shape}; rebuild "
            "the state with init_powerSGD_state for this plan."
        )


def powerSGD_hook(
    state: PowerSGDState, bucket: GradBucket, config: PowerSGDConfig = PowerSGDConfig()
) -> tuple[jax.Array, PowerSGDState]:
    """Reduces one bucket with PowerSGD (plain allreduce for the first steps).

    Args:
        state: this rank's :class:`PowerSGDState`.
        bucket: the bucket to reduce.
        config: the hyperparameters; bind them with ``functools.partial`` or use
            ``make_comm_hook('powerSGD', **config)``.

    Returns:
        The averaged (approximated) buffer and the new state.
    """
    _check_state(state, bucket, config)
    axis = bucket.axis_name
    world_size = axis_size(axis)
    layout = _layout(bucket.shapes, config)

    def vanilla(state):
        out = jax.lax.psum(bucket.buffer / jnp.asarray(world_size, bucket.buffer.dtype), axis)
        return out, to_varying(state.errors, axis), to_varying(state.q_memory, axis)

    def compressed(state):
        out, errors, q_memory = _compress_step(state, bucket, config, layout, world_size)
        return out, to_varying(errors, axis), to_varying(q_memory, axis)

    out, errors, q_memory = jax.lax.cond(
        state.iteration < config.start_powerSGD_iter, vanilla, compressed, state
    )
    iteration = state.iteration + 1 if bucket.is_last else state.iteration
    return out, PowerSGDState(iteration, errors, q_memory)
