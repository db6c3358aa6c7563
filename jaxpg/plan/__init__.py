"""The layout planner and preflight: choose the degrees, microbatches and recomputation of a
job, predict each layout's memory and step time, and name every configuration error before
launch.

``search(job)`` ranks the layouts that fit; ``evaluate(layout, job)`` predicts one;
``check(layout, job)`` raises a :class:`LayoutError` naming each problem with its fix. A model
is a :class:`TransformerSpec` (presets: :func:`get_model`); the devices a :class:`Hardware`
profile (presets: :func:`get_hardware`, TOML files, or ``calibrate()`` for this machine).
The command line is ``jaxpg-plan`` (:mod:`jaxpg.plan.cli`). See docs/planner.md.

Example:
    >>> from jaxpg import plan
    >>> job = plan.Job(model=plan.get_model("llama3-70b"), devices=512,
    ...                hardware="h100-80gb", seq_len=8192, global_batch=512)
    >>> best = plan.search(job, top=1)[0]
    >>> best.parallel_dims().product
    512
"""

from jaxpg.plan.estimate import JSON_KEYS, Estimate, evaluate
from jaxpg.plan.hardware import (
    HARDWARE,
    Hardware,
    Link,
    available_hardware,
    get_hardware,
    load_hardware,
    save_hardware,
)
from jaxpg.plan.job import Job
from jaxpg.plan.layout import Layout
from jaxpg.plan.memory import Memory, memory
from jaxpg.plan.preflight import LayoutError, Problem, check, problems
from jaxpg.plan.presets import MODELS, available_models, get_model
from jaxpg.plan.search import candidates, search
from jaxpg.plan.spec import TransformerSpec
from jaxpg.plan.step_time import StepTime, step_time

__all__ = [
    "HARDWARE", "JSON_KEYS", "MODELS", "Estimate", "Hardware", "Job", "Layout", "LayoutError",
    "Link", "Memory", "Problem", "StepTime", "TransformerSpec", "available_hardware",
    "available_models", "candidates", "check", "evaluate", "get_hardware", "get_model",
    "load_hardware", "memory", "problems", "save_hardware", "search", "step_time",
]  # fmt: skip
