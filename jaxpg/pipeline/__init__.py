"""Pipeline parallelism: schedules as timetables, their executors, and torch's and Paddle's
stage and schedule classes over Flax NNX modules.

The package exports what a user calls; the schedule builders, ``Action``, costs, buffer
plans, stage metadata and other parts of the executors are reached through their modules
(``jaxpg.pipeline.schedule.builders``, ``jaxpg.pipeline.schedule.timetable``,
``jaxpg.pipeline.schedule.costs``...). The package's folders: ``schedule/`` (timetables in
plain Python), ``stage/`` (what one stage computes), ``lockstep/`` (``executor="spmd"``) and
``process/`` (``executor="mpmd"``); beside them ``api.py``, ``train_step.py`` and torch's and
Paddle's faces (``torch_api.py``, ``paddle_api.py``).
``ScheduleDualPipeV`` and ``ScheduleLoopedBFS`` are attributes of the package, as torch's
are of ``torch.distributed.pipelining``, outside ``__all__``, which keeps to at most 25
names.
"""

from jaxpg.pipeline.api import StagedParams, pipeline_value_and_grad
from jaxpg.pipeline.paddle_api import LayerDesc, PipelineLayer
from jaxpg.pipeline.schedule.builders import available_schedules, get_schedule
from jaxpg.pipeline.schedule.checker import check_timetable
from jaxpg.pipeline.schedule.render import render_png, render_text
from jaxpg.pipeline.schedule.timetable import Timetable
from jaxpg.pipeline.stage.microbatch import merge_microbatches, split_microbatches
from jaxpg.pipeline.stage.nnx_stages import split_module, stack_modules
from jaxpg.pipeline.torch_api import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from jaxpg.pipeline.torch_api import ScheduleDualPipeV as ScheduleDualPipeV
from jaxpg.pipeline.torch_api import ScheduleLoopedBFS as ScheduleLoopedBFS
from jaxpg.pipeline.train_step import init_train_state, make_train_step

__all__ = [
    # the functional API: one jitted step (or the process executor) over a mesh
    "pipeline_value_and_grad", "make_train_step", "init_train_state", "StagedParams",
    "split_microbatches", "merge_microbatches", "stack_modules",
    "split_module",
    # schedules as timetables
    "Timetable", "get_schedule", "available_schedules", "check_timetable", "render_text",
    "render_png",
    # torch's faces
    "PipelineStage", "PipelineScheduleSingle", "PipelineScheduleMulti", "ScheduleGPipe",
    "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    # Paddle's
    "LayerDesc", "PipelineLayer",
]
