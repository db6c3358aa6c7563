"""``StagedParams``: the parameters of a pipelined model."""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["StagedParams"]


class StagedParams(NamedTuple):
    """Parameters of a pipelined model.

    Attributes:
        stages: the repeated block's parameters, stacked with leading dimension
            ``p * v``, in model order (or in rank order: ``jaxpg.pipeline.stage.order``).
        first: the embedding's parameters (used by ``first_fn`` on stage 0), or ``()``.
        last: the head's parameters (used by ``loss_fn`` on the last stage), or ``()``.
    """

    stages: Any
    first: Any = ()
    last: Any = ()
