"""The point-to-point metadata header (Paddle's send_meta/recv_meta), as int32 words.

A receiver that does not know what is coming first receives the header's length, then
the header: ``[tensor_type, (tensor_num,) {shape_len, *shape, dtype_code, stop_gradient}...]``
with ``tensor_type`` 0 for one tensor and 1 for several, exactly the seed's layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = ["TensorMeta", "encode_meta", "decode_meta", "DTYPE_CODES"]

# Paddle's PADDLE_TO_NUMBER, extended with the dtypes JAX adds.
DTYPE_CODES: dict[str, int] = {
    "float16": 0, "float32": 1, "float64": 2, "int32": 3, "int64": 4, "bfloat16": 5,
    "bool": 6, "int8": 7, "uint8": 8, "int16": 9, "uint16": 10, "uint32": 11, "uint64": 12,
    "complex64": 13, "complex128": 14,
}
_CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


class TensorMeta(NamedTuple):
    """What a receiver needs to allocate one tensor."""

    shape: tuple[int, ...]
    dtype: str
    stop_gradient: bool = False


def encode_meta(metas: Sequence[TensorMeta], *, several: bool) -> np.ndarray:
    """Encodes tensor metadata as the seed's int message (without the length word)."""
    words = [1 if several else 0]
    if several:
        words.append(len(metas))
    elif len(metas) != 1:
        raise ValueError(f"encode_meta: several=False needs exactly one tensor; got {len(metas)}.")
    for m in metas:
        if m.dtype not in DTYPE_CODES:
            raise ValueError(f"point-to-point: dtype {m.dtype!r} cannot be sent; supported: "
                             f"{sorted(DTYPE_CODES)}.")
        words += [len(m.shape), *m.shape, DTYPE_CODES[m.dtype], int(m.stop_gradient)]
    return np.asarray(words, np.int32)


def decode_meta(words: Sequence[int]) -> tuple[list[TensorMeta], bool]:
    """Decodes a message from :func:`encode_meta`; returns ``(metas, several)``."""
    data = [int(w) for w in words]
    tensor_type = data.pop(0)
    num = data.pop(0) if tensor_type == 1 else 1
    metas = []
    for _ in range(num):
        shape_len = data.pop(0)
        shape = tuple(data[:shape_len])
        data = data[shape_len:]
        dtype = _CODE_DTYPES[data.pop(0)]
        metas.append(TensorMeta(shape, dtype, bool(data.pop(0))))
    if data:
        raise ValueError(f"point-to-point header has {len(data)} words left over: {data}.")
    return metas, tensor_type == 1
