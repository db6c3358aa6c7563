"""One pipeline rank per process: the layout the stage classes run, checked before a step.

``PipelineStage`` and its schedules (and Paddle's ``PipelineLayer``) are the process
executor of stages that differ: every process runs its own stage's actions from host code
and trades activations with its neighbours' processes (``jaxpg.pipeline.process.stage_runner``).
A pipeline group with several ranks in one process (one process with several devices,
a notebook's 8 CPU devices) has no process per rank to run them; neither does a
data-parallel group whose gradient average would have to stack several local ranks. Such
a layout is refused where the schedule is made, naming the two ways that work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

__all__ = ["local_rank_count", "refuse_local_ranks"]


def local_rank_count(group: Any) -> int:
    """How many of ``group``'s ranks (devices) live in this process."""
    here = jax.process_index()
    return sum(1 for d in group.devices if d.process_index == here)


def refuse_local_ranks(stages: Sequence[Any], api: str) -> None:
    """Raises ``ValueError`` unless each stage's pipeline (and data-parallel) group has
    exactly one rank in this process.

    Args:
        stages: this process's ``PipelineStage`` s.
        api: the caller, for the message (``"Schedule1F1B"``, ``"PipelineLayer"``).
    """
    for st in stages:
        for what, group in (("pipeline", st.group), ("data-parallel", st.dp_group)):
            if group is None:
                continue
            count = local_rank_count(group)
            if count > 1:
                raise ValueError(
                    f"{api}: this process holds {count} ranks of the {what} group {group!r} "
                    "(one process with several devices); PipelineStage and its schedules "
                    "run one pipeline rank per process, each process calling step for its "
                    "own stage. Launch one process per device (jaxpg-run --nproc-per-node "
                    f"{count}, as torchrun), or, in one process, pipeline stacked stages "
                    "with jaxpg.pipeline.make_train_step(stage_fn, loss_fn, optimizer, "
                    "mesh=..., param_specs=...), which runs every stage in one program over "
                    "this process's devices."
                )
