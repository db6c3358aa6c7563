"""Assigning gradients to buckets by size, as torch's DistributedDataParallel does.

A :class:`BucketPlan` is data: it is made once from the parameters' shapes and
dtypes, printed for the user, and then applied in every step by
:func:`jaxpg.ddp.reduce_gradients`.

The algorithm mirrors ``compute_bucket_assignment_by_size`` in torch's
``torch/csrc/distributed/c10d/reducer.cpp`` together with the call in
``DistributedDataParallel._ddp_init_helper``:

1. Walk the parameters in definition order (here: ``jax.tree_util`` flatten
   order) and append each one to the open bucket of its dtype (torch keys
   buckets by scalar type and device; in SPMD every rank holds one device).
2. The size limits are the list ``[first_bucket_bytes, bucket_cap_bytes]``, with
   one cursor into it per dtype. A bucket is closed as soon as its size in bytes
   *reaches* (``>=``) the current limit of its dtype; the cursor then moves on to
   the next limit and stays on the last one. So the first bucket of each dtype
   is small (1 MiB by default) and later ones are capped at 25 MiB.
3. The still-open buckets are closed, all buckets are sorted by the smallest
   parameter index they hold, and the list is *reversed*: backward produces the
   gradients of the last-defined parameters first, so bucket 0 is the first one
   ready.

A parameter larger than the cap gets a bucket of its own (it is never split).
Recent torch versions start with a single ``[sys.maxsize]`` limit and rebuild the
buckets after the first iteration from the observed gradient order; jaxpg's
buckets are static (shapes are known before tracing), so the plan above is the
one torch's documentation describes and the one used for every step.

Example:
    >>> import jax.numpy as jnp
    >>> params = {
    ...     "layer1": {"kernel": jnp.zeros((512, 1024))},
    ...     "layer2": {"bias": jnp.zeros((1024,)), "kernel": jnp.zeros((1024, 1024))},
    ... }
    >>> plan = make_bucket_plan(params, bucket_cap_mb=25, first_bucket_mb=1)
    >>> [b.paths for b in plan.buckets]
    [("['layer2']['bias']", "['layer2']['kernel']"), ("['layer1']['kernel']",)]
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One bucket: parameters of one dtype reduced together as a flat buffer.

    Attributes:
        index: position in the plan (0 is reduced first).
        paths: ``jax.tree_util.keystr`` path of each parameter, in buffer order.
        dtype: the common dtype of the bucket's parameters.
        sizes: number of elements of each parameter.
        offsets: element offset of each parameter in the flat buffer.
        nbytes: size of the flat buffer in bytes.
        shapes: shape of each parameter.
        leaf_indices: index of each parameter in the flattened pytree.
        size_limit: the byte limit that was in force when the bucket was filled
            (torch's ``per_bucket_size_limits``).
    """

    index: int
    paths: tuple[str, ...]
    dtype: np.dtype
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    nbytes: int
    shapes: tuple[tuple[int, ...], ...]
    leaf_indices: tuple[int, ...]
    size_limit: int

    @property
    def numel(self) -> int:
        """Total number of elements in the bucket's flat buffer."""
        return sum(self.sizes)


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """The bucket assignment of a whole parameter pytree.

    Attributes:
        buckets: the buckets in reduction order (torch's reversed order).
        leaf_paths: ``keystr`` path of every leaf, in flatten order.
        leaf_shapes: shape of every leaf, in flatten order.
        leaf_dtypes: dtype of every leaf, in flatten order.
        bucket_cap_bytes: the cap for every bucket after the first of a dtype.
        first_bucket_bytes: the limit for the first bucket of each dtype.
    """

    buckets: tuple[Bucket, ...]
    leaf_paths: tuple[str, ...]
    leaf_shapes: tuple[tuple[int, ...], ...]
    leaf_dtypes: tuple[np.dtype, ...]
    bucket_cap_bytes: int
    first_bucket_bytes: int

    def __len__(self) -> int:
        return len(self.buckets)

    def __iter__(self):
        return iter(self.buckets)

    @property
    def total_bytes(self) -> int:
        """Bytes of all gradients together."""
        return sum(b.nbytes for b in self.buckets)

    def table(self) -> str:
        """A human-readable table: index, dtype, bytes and parameter paths."""
        rows = [("bucket", "dtype", "bytes", "params", "paths")]
        for b in self.buckets:
            rows.append(
                (str(b.index), str(b.dtype), str(b.nbytes), str(len(b.paths)), ", ".join(b.paths))
            )
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [
            f"BucketPlan: {len(self.buckets)} buckets, {self.total_bytes} bytes, "
            f"cap {self.bucket_cap_bytes} bytes, first bucket {self.first_bucket_bytes} bytes"
        ]
        for r in rows:
            lines.append("  ".join(r[i].rjust(widths[i]) for i in range(4)) + "  " + r[4])
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _limit_bytes(name: str, value_mb: Any) -> int:
    if isinstance(value_mb, bool) or not isinstance(value_mb, int | float):
        raise TypeError(f"{name}={value_mb!r} must be a number of megabytes (MiB), e.g. 25.")
    if not math.isfinite(value_mb) or value_mb <= 0:
        raise ValueError(f"{name}={value_mb!r} must be a positive number of megabytes (MiB).")
    nbytes = int(value_mb * MIB)
    if nbytes < 1:
        raise ValueError(
            f"{name}={value_mb!r} is below one byte ({value_mb} * 2**20 < 1); pass a larger value."
        )
    return nbytes


def _leaf_info(leaf: Any, path: str) -> tuple[tuple[int, ...], np.dtype]:
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"The leaf at {path} ({type(leaf).__name__}) has no shape and dtype; pass arrays "
            "or jax.ShapeDtypeStruct leaves to make_bucket_plan."
        )
    return tuple(int(d) for d in shape), np.dtype(dtype)


def assign_buckets(
    nbytes: list[int], keys: list[Any], size_limits: list[int]
) -> list[tuple[list[int], int]]:
    """torch's ``compute_bucket_assignment_by_size`` on plain numbers.

    Args:
        nbytes: size in bytes of each tensor, in definition order.
        keys: the bucket key of each tensor (its dtype).
        size_limits: the consecutive byte limits, e.g. ``[1 MiB, 25 MiB]``.

    Returns:
        ``(tensor indices, size limit)`` per bucket, sorted by the smallest index
        (not yet reversed).
    """
    result: list[tuple[list[int], int]] = []
    open_buckets: dict[Any, list[int]] = {}
    open_sizes: dict[Any, int] = {}
    cursors: dict[Any, int] = {}
    for i, (size, key) in enumerate(zip(nbytes, keys, strict=True)):
        open_buckets.setdefault(key, []).append(i)
        open_sizes[key] = open_sizes.get(key, 0) + size
        cursor = cursors.setdefault(key, 0)
        if open_sizes[key] >= size_limits[cursor]:
            result.append((open_buckets.pop(key), size_limits[cursor]))
            open_sizes[key] = 0
            cursors[key] = min(cursor + 1, len(size_limits) - 1)
    for key, indices in open_buckets.items():
        result.append((indices, size_limits[cursors[key]]))
    result.sort(key=lambda bucket: min(bucket[0]))
    return result


def make_bucket_plan(
    params_or_shapes: Any, bucket_cap_mb: float = 25, first_bucket_mb: float = 1
) -> BucketPlan:
    """Assigns the leaves of a parameter pytree to gradient buckets, as torch's DDP does.

    Args:
        params_or_shapes: a pytree whose leaves have ``shape`` and ``dtype``
            (arrays or ``jax.ShapeDtypeStruct``), e.g. ``nnx.state(model, nnx.Param)``.
        bucket_cap_mb: size cap of every bucket after the first of each dtype,
            in MiB (torch's ``bucket_cap_mb``, default 25).
        first_bucket_mb: size limit of the first bucket of each dtype, in MiB
            (torch's ``dist._DEFAULT_FIRST_BUCKET_BYTES`` = 1 MiB).

    Returns:
        The :class:`BucketPlan`, buckets in reduction order.

    Raises:
        ValueError: if a cap is not positive.
        TypeError: if a cap is not a number, or a leaf has no shape or dtype.
    """
    cap = _limit_bytes("bucket_cap_mb", bucket_cap_mb)
    first = _limit_bytes("first_bucket_mb", first_bucket_mb)
    leaves_with_paths, _ = jax.tree_util.tree_flatten_with_path(params_or_shapes)
    paths = tuple(jax.tree_util.keystr(p) for p, _ in leaves_with_paths)
    infos = [
        _leaf_info(leaf, path) for (_, leaf), path in zip(leaves_with_paths, paths, strict=True)
    ]
    shapes = tuple(s for s, _ in infos)
    dtypes = tuple(d for _, d in infos)
    sizes = [math.prod(s) for s in shapes]
    nbytes = [n * d.itemsize for n, d in zip(sizes, dtypes, strict=True)]

    assignment = assign_buckets(nbytes, list(dtypes), [first, cap])
    buckets = []
    for index, (leaf_indices, limit) in enumerate(reversed(assignment)):
        b_sizes = tuple(sizes[i] for i in leaf_indices)
        offsets = tuple(int(o) for o in np.cumsum((0,) + b_sizes[:-1]))
        buckets.append(
            Bucket(
                index=index,
                paths=tuple(paths[i] for i in leaf_indices),
                dtype=dtypes[leaf_indices[0]],
                sizes=b_sizes,
                offsets=offsets,
                nbytes=sum(nbytes[i] for i in leaf_indices),
                shapes=tuple(shapes[i] for i in leaf_indices),
                leaf_indices=tuple(leaf_indices),
                size_limit=limit,
            )
        )
    return BucketPlan(
        buckets=tuple(buckets),
        leaf_paths=paths,
        leaf_shapes=shapes,
        leaf_dtypes=dtypes,
        bucket_cap_bytes=cap,
        first_bucket_bytes=first,
    )
