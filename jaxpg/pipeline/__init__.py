"""Pipeline parallelism: schedules as timetables, their executors, and torch's and Paddle's
stage and schedule classes over Flax NNX modules."""

from jaxpg.pipeline.buffer_plan import BufferPlan, plan_buffers
from jaxpg.pipeline.checker import check_timetable, default_in_flight_limits, peak_in_flight
from jaxpg.pipeline.costs import (
    ActionCosts,
    TimedTimetable,
    default_costs,
    lockstep_time,
    measure_costs,
    timed,
)
from jaxpg.pipeline.executor import StagedParams, pipeline_value_and_grad
from jaxpg.pipeline.hybrid import bucketed_grad_reducer
from jaxpg.pipeline.mesh import pipeline_mesh
from jaxpg.pipeline.microbatch import merge_microbatches, split_microbatches
from jaxpg.pipeline.nnx_stages import module_fn, split_module, stack_modules
from jaxpg.pipeline.pipeline_layer import LayerDesc, PipelineLayer, segment_layers
from jaxpg.pipeline.pipeline_stage import PipelineStage
from jaxpg.pipeline.render import render_png, render_text
from jaxpg.pipeline.schedule_classes import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from jaxpg.pipeline.schedules import (
    available_schedules,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    theory_bubble_fraction,
    theory_ticks,
    zero_bubble_h1,
    zero_bubble_v,
)
from jaxpg.pipeline.stage_meta import StageMeta, infer_stage_metadata
from jaxpg.pipeline.stage_order import to_model_order, to_rank_order
from jaxpg.pipeline.stage_split import StagePieces, split_stage
from jaxpg.pipeline.timetable import Action, Timetable
from jaxpg.pipeline.train_step import init_train_state, make_train_step, place_pipeline_params
from jaxpg.pipeline.zero import init_zero_train_state, make_zero_train_step

__all__ = [
    "Action", "Timetable", "gpipe", "one_f_one_b", "interleaved_1f1b",
    "zero_bubble_h1", "zero_bubble_v", "get_schedule", "available_schedules", "theory_ticks",
    "theory_bubble_fraction", "check_timetable", "peak_in_flight", "default_in_flight_limits",
    "render_text", "render_png", "StagedParams", "pipeline_value_and_grad", "make_train_step",
    "init_train_state", "place_pipeline_params", "pipeline_mesh", "split_microbatches",
    "merge_microbatches", "StageMeta", "infer_stage_metadata", "BufferPlan", "plan_buffers",
    "stack_modules", "split_module", "module_fn", "bucketed_grad_reducer", "ActionCosts",
    "TimedTimetable", "default_costs", "lockstep_time", "measure_costs", "timed",
    "StagePieces", "split_stage", "to_rank_order", "to_model_order",
    "init_zero_train_state", "make_zero_train_step",
    "PipelineStage", "PipelineScheduleSingle", "PipelineScheduleMulti", "ScheduleGPipe",
    "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble", "LayerDesc", "PipelineLayer", "segment_layers",
]
