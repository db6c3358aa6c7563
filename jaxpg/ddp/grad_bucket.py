"""The value a communication hook receives: one bucket's flat gradient buffer.

This is jaxpg's counterpart of torch's ``dist.GradBucket``. It is a
``NamedTuple`` whose static fields (paths, shapes, offsets, ``is_last``,
``axis_name``) are plain Python values known at trace time; only ``buffer`` is
a traced array.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax


class GradBucket(NamedTuple):
    """One bucket of gradients, flattened into a single 1-D buffer.

    Attributes:
        index: the bucket's position in the plan (0 is reduced first).
        buffer: the 1-D concatenation of the bucket's raveled gradients.
        paths: ``jax.tree_util.keystr`` path of each gradient in the buffer.
        is_last: whether this is the last bucket of the step (torch's
            ``GradBucket.is_last()``); stateful hooks count steps on it.
        axis_name: the ``shard_map`` mesh axis (or axes) to reduce over.
        shapes: shape of each gradient in the buffer.
        offsets: element offset of each gradient in the buffer.
    """

    index: int
    buffer: jax.Array
    paths: tuple[str, ...]
    is_last: bool
    axis_name: Any
    shapes: tuple[tuple[int, ...], ...] = ()
    offsets: tuple[int, ...] = ()

    def gradients(self, buffer: jax.Array | None = None) -> list[jax.Array]:
        """Per-parameter views of ``buffer`` (default: this bucket's buffer).

        Like torch's ``GradBucket.gradients()``: each gradient reshaped to its
        parameter's shape.
        """
        flat = self.buffer if buffer is None else buffer
        out = []
        for shape, offset in zip(self.shapes, self.offsets, strict=True):
            size = 1
            for d in shape:
                size *= d
            out.append(flat[offset : offset + size].reshape(shape))
        return out
