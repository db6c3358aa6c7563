"""DDP communication hooks: how one bucket's flat gradient buffer is reduced.

A hook is a pure function, called inside ``shard_map`` once per bucket::

    def hook(state, bucket: GradBucket) -> tuple[jax.Array, state]:
        ...

It receives the hook state (any pytree, or ``None`` for stateless hooks) and a
:class:`GradBucket` whose ``buffer`` is the bucket's 1-D gradient buffer on this
rank, and returns the reduced buffer (same shape and dtype) and the new state.
Communication goes through ``jax.lax`` collectives over ``bucket.axis_name``.
Hooks are the functional counterpart of torch's
``DistributedDataParallel.register_comm_hook(state, hook)``, whose hooks mutate
the state and return a ``Future``; here the state is threaded through the
reducer and returned, so it can live in a ``jit`` carry or a checkpoint.

The hooks here follow ``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``:

- :func:`allreduce_hook`: divide by the world size, then sum over the axis
  (torch divides first to avoid overflow). This is DDP's default behaviour.
- :func:`fp16_compress_hook` / :func:`bf16_compress_hook`: cast to the low
  precision dtype, *then* divide by the world size in that dtype, sum in that
  dtype, and cast the result back (torch's ``buffer.to(dtype).div_(world_size)``
  followed by ``all_reduce`` and ``copy_`` into the original buffer).
- :func:`noop_hook`: no communication at all (torch's ``noop_hook`` in
  ``debugging_hooks.py``); useful to measure the cost of the rest of the step.
- :func:`~jaxpg.ddp.powersgd.powerSGD_hook`: PowerSGD low-rank compression.

Example, a custom hook that averages and counts the steps in its state::

    def my_hook(step, bucket):
        n = jax.lax.axis_size(bucket.axis_name)
        out = jax.lax.psum(bucket.buffer / n, bucket.axis_name)
        return out, step + bucket.is_last

    grads, step = reduce_gradients(grads, plan, "dp", my_hook, hook_state=jnp.int32(0))
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxpg.ddp import powersgd
from jaxpg.ddp._axis import axis_size
from jaxpg.ddp.grad_bucket import GradBucket

CommHook = Callable[[Any, GradBucket], tuple[jax.Array, Any]]
InitStateFn = Callable[[Any], Any]


def allreduce_hook(state: Any, bucket: GradBucket) -> tuple[jax.Array, Any]:
    """Averages the bucket over the axis: ``psum(buffer / world_size)``.

    Args:
        state: passed through unchanged (``None`` for this hook).
        bucket: the bucket to reduce.

    Returns:
        The averaged buffer and ``state``.
    """
    world_size = axis_size(bucket.axis_name)
    if world_size == 1:  # XLA:CPU would still run (and copy through) a one-rank all-reduce
        return bucket.buffer, state
    buffer = bucket.buffer / jnp.asarray(world_size, bucket.buffer.dtype)
    return jax.lax.psum(buffer, bucket.axis_name), state


def _compress_hook(dtype: Any, state: Any, bucket: GradBucket) -> tuple[jax.Array, Any]:
    world_size = axis_size(bucket.axis_name)
    compressed = bucket.buffer.astype(dtype) / jnp.asarray(world_size, dtype)
    reduced = jax.lax.psum(compressed, bucket.axis_name)
    return reduced.astype(bucket.buffer.dtype), state


def fp16_compress_hook(state: Any, bucket: GradBucket) -> tuple[jax.Array, Any]:
    """Casts to float16, divides by the world size, sums, and casts back.

    The order of operations is torch's: ``buffer.to(float16).div_(world_size)``,
    ``all_reduce`` in float16, then copy back into the buffer's dtype.
    """
    return _compress_hook(jnp.float16, state, bucket)


def bf16_compress_hook(state: Any, bucket: GradBucket) -> tuple[jax.Array, Any]:
    """Casts to bfloat16, divides by the world size, sums, and casts back.

    Same order of operations as :func:`fp16_compress_hook`.
    """
    return _compress_hook(jnp.bfloat16, state, bucket)


def noop_hook(state: Any, bucket: GradBucket) -> tuple[jax.Array, Any]:
    """Returns the local buffer unchanged, with no communication."""
    return bucket.buffer, state


def _no_state(plan: Any) -> None:
    del plan
    return None


_NAMED_HOOKS: dict[str, CommHook] = {
    "allreduce": allreduce_hook,
    "fp16_compress": fp16_compress_hook,
    "bf16_compress": bf16_compress_hook,
    "noop": noop_hook,
}


def make_comm_hook(name_or_callable: str | CommHook, **config: Any) -> tuple[CommHook, InitStateFn]:
    """Returns ``(hook, init_state_fn)`` for a named hook or a custom callable.

    ``init_state_fn(plan)`` builds the hook's initial state from a
    :class:`~jaxpg.ddp.BucketPlan` (``None`` for stateless hooks).

    Args:
        name_or_callable: ``'allreduce'``, ``'fp16_compress'``,
            ``'bf16_compress'``, ``'noop'`` or ``'powerSGD'`` (a trailing
            ``'_hook'`` and letter case are ignored), or a hook callable.
        **config: for ``'powerSGD'``, the fields of
            :class:`~jaxpg.ddp.PowerSGDConfig`; for a callable, optionally
            ``init_state_fn``. Other hooks take no configuration.

    Returns:
        The hook and its state initialiser.

    Raises:
        ValueError: for an unknown hook name.
        TypeError: for configuration a hook does not take.
    """
    if callable(name_or_callable):
        init = config.pop("init_state_fn", _no_state)
        if config:
            raise TypeError(
                f"make_comm_hook got configuration {sorted(config)} for a custom hook; bind it "
                "with functools.partial instead, and pass init_state_fn= for its state."
            )
        return name_or_callable, init
    if not isinstance(name_or_callable, str):
        raise TypeError(f"{name_or_callable=} must be a hook name (str) or a callable.")
    key = name_or_callable.lower().removesuffix("_hook")
    if key in ("powersgd", "power_sgd"):
        cfg = powersgd.PowerSGDConfig(**config)
        return (
            functools.partial(powersgd.powerSGD_hook, config=cfg),
            functools.partial(powersgd.init_powerSGD_state, config=cfg),
        )
    if key not in _NAMED_HOOKS:
        raise ValueError(
            f"{name_or_callable=} is not a known hook; choose one of "
            f"{sorted(_NAMED_HOOKS) + ['powerSGD']} or pass a callable."
        )
    if config:
        raise TypeError(f"The {key!r} hook takes no configuration, got {sorted(config)}.")
    return _NAMED_HOOKS[key], _no_state


PowerSGDConfig = powersgd.PowerSGDConfig
PowerSGDState = powersgd.PowerSGDState
powerSGD_hook = powersgd.powerSGD_hook
init_powerSGD_state = powersgd.init_powerSGD_state
