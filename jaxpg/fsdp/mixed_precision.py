"""``MixedPrecisionPolicy``: torch FSDP2's casts, for the gathered parameters and gradients.

The sharded parameters (and the optimizer state) stay in their own dtype, usually
float32. With ``param_dtype`` set, each shard is cast to it *before* the all-gather, so
the gather moves ``param_dtype`` bytes and forward and backward compute in it; the
unsharded gradients come out in ``param_dtype``, are cast to ``reduce_dtype`` (by default
``param_dtype``, as torch), reduce-scattered and averaged in it, and cast back to the
shard's dtype for the optimizer. ``output_dtype`` casts the floating-point outputs of
each unit and of the root's forward; ``cast_forward_inputs`` casts their floating-point
inputs to ``param_dtype``. Integer arrays are never cast.

Example:
    >>> import jax.numpy as jnp
    >>> policy = MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    >>> policy.reduce_dtype_for(jnp.float32)
    dtype('float32')
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["MixedPrecisionPolicy", "cast_floating"]


def _float_dtype(name: str, value: Any) -> np.dtype | None:
    if value is None:
        return None
    try:
        dtype = np.dtype(value)
    except TypeError as e:
        raise TypeError(f"MixedPrecisionPolicy: {name}={value!r} is not a dtype.") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"MixedPrecisionPolicy: {name}={dtype} must be a floating-point dtype "
            "(jnp.bfloat16, jnp.float16 or jnp.float32), or None to keep the parameter's."
        )
    return dtype


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """torch's ``MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype,
    cast_forward_inputs)``.

    Attributes:
        param_dtype: dtype of the gathered (unsharded) parameters and of the compute;
            None keeps each parameter's own dtype.
        reduce_dtype: dtype of the gradient reduce-scatter; None uses ``param_dtype`` (or
            the parameter's dtype without one).
        output_dtype: dtype of the floating-point outputs of units and of the root
            module's forward; None leaves them.
        cast_forward_inputs: cast the floating-point inputs of units and of the root
            module's forward to ``param_dtype``.
    """

    param_dtype: Any = None
    reduce_dtype: Any = None
    output_dtype: Any = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            object.__setattr__(self, name, _float_dtype(name, getattr(self, name)))
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(
                f"MixedPrecisionPolicy: cast_forward_inputs={self.cast_forward_inputs!r} "
                "must be a bool."
            )

    def compute_dtype_for(self, dtype: Any) -> np.dtype:
        """The gathered dtype of a parameter stored in ``dtype`` (ints are kept)."""
        dtype = np.dtype(dtype)
        if self.param_dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            return dtype
        return self.param_dtype

    def reduce_dtype_for(self, dtype: Any) -> np.dtype:
        """The dtype gradients of a parameter stored in ``dtype`` are reduced in."""
        dtype = np.dtype(dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            return dtype
        return self.reduce_dtype or self.param_dtype or dtype

    def cast_inputs(self, tree: Any) -> Any:
        """``tree`` with floating-point arrays cast to ``param_dtype`` (if it applies)."""
        if not self.cast_forward_inputs or self.param_dtype is None:
            return tree
        return cast_floating(tree, self.param_dtype)

    def cast_outputs(self, tree: Any) -> Any:
        """``tree`` with floating-point arrays cast to ``output_dtype`` (if set)."""
        return tree if self.output_dtype is None else cast_floating(tree, self.output_dtype)


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Casts the floating-point array leaves of ``tree`` to ``dtype``; the rest is kept."""

    def cast(x):
        if isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)
