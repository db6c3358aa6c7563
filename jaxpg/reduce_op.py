"""Reduction operators, as torch.distributed.ReduceOp, with their dtype rules."""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

__all__ = ["ReduceOp", "RedOpType"]


class RedOpType(enum.Enum):
    """The kind of a reduction, without its PREMUL_SUM factor."""

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"
    AVG = "avg"
    PREMUL_SUM = "premul_sum"


_BITWISE = {RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR}
_COMPLEX_OK = {RedOpType.SUM, RedOpType.AVG, RedOpType.PREMUL_SUM}


class ReduceOp:
    """A reduction applied across ranks: ``ReduceOp.SUM``, ..., ``ReduceOp.PREMUL_SUM(factor)``.

    ``PREMUL_SUM(factor)`` multiplies each rank's input by ``factor`` and sums, as NCCL's
    ``ncclRedOpCreatePreMulSum`` does (torch builds it with ``_make_nccl_premul_sum``).

    Example:
        >>> ReduceOp.PREMUL_SUM(0.5)
        ReduceOp.PREMUL_SUM(0.5)
    """

    SUM: ReduceOp
    PRODUCT: ReduceOp
    MIN: ReduceOp
    MAX: ReduceOp
    BAND: ReduceOp
    BOR: ReduceOp
    BXOR: ReduceOp
    AVG: ReduceOp

    __slots__ = ("kind", "factor")

    def __init__(self, kind: RedOpType, factor: float | None = None):
        self.kind = kind
        self.factor = factor

    @staticmethod
    def PREMUL_SUM(factor: float) -> ReduceOp:  # noqa: N802 (torch's name)
        """Returns the pre-multiplied sum: each input is scaled by ``factor``, then summed."""
        if isinstance(factor, ReduceOp) or not np.isscalar(factor):
            raise TypeError(
                f"ReduceOp.PREMUL_SUM takes a Python or NumPy scalar factor; got {factor!r}."
            )
        return ReduceOp(RedOpType.PREMUL_SUM, float(factor))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RedOpType):
            return self.kind == other
        return (
            isinstance(other, ReduceOp) and self.kind == other.kind and self.factor == other.factor
        )

    def __hash__(self) -> int:
        return hash((self.kind, self.factor))

    def __repr__(self) -> str:
        if self.kind is RedOpType.PREMUL_SUM:
            return f"ReduceOp.PREMUL_SUM({self.factor})"
        return f"ReduceOp.{self.kind.name}"


for _kind in RedOpType:
    if _kind is not RedOpType.PREMUL_SUM:
        setattr(ReduceOp, _kind.name, ReduceOp(_kind))


def as_reduce_op(op: Any, dtype: Any, *, api: str) -> ReduceOp:
    """Validates ``op`` for an array of ``dtype`` and returns it as a ReduceOp.

    Raises:
        ValueError: the op is not valid for the dtype (bitwise on floats, MIN on complex, ...).
        TypeError: ``op`` is not a ReduceOp.
    """
    if isinstance(op, RedOpType) and op is not RedOpType.PREMUL_SUM:
        op = ReduceOp(op)
    if not isinstance(op, ReduceOp):
        if op is ReduceOp.PREMUL_SUM or op is RedOpType.PREMUL_SUM:
            raise ValueError(
                f"{api}: op=ReduceOp.PREMUL_SUM needs a factor; pass ReduceOp.PREMUL_SUM(factor)."
            )
        raise TypeError(f"{api}: op must be a jaxpg.ReduceOp such as ReduceOp.SUM; got {op!r}.")
    dt = np.dtype(dtype)
    is_int_or_bool = np.issubdtype(dt, np.integer) or dt == np.bool_
    if op.kind in _BITWISE and not is_int_or_bool:
        raise ValueError(
            f"{api}: op={op!r} is a bitwise reduction and needs an integer or bool array; "
            f"got dtype={dt.name}. Use SUM, MIN, MAX or PRODUCT for floating-point data."
        )
    if np.issubdtype(dt, np.complexfloating) and op.kind not in _COMPLEX_OK:
        raise ValueError(
            f"{api}: op={op!r} is not defined for complex dtype={dt.name}; "
            "use ReduceOp.SUM, ReduceOp.AVG or ReduceOp.PREMUL_SUM."
        )
    if op.kind in (RedOpType.AVG, RedOpType.PREMUL_SUM) and is_int_or_bool:
        raise ValueError(
            f"{api}: op={op!r} needs a floating-point or complex array; got dtype={dt.name}. "
            "Cast to a float dtype first, or use ReduceOp.SUM and divide."
        )
    return op
