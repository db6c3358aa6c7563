"""The recipe's TOML config: one dataclass per table, validated when read.

Every table and key is optional but ``[model]``'s ``name`` (or ``family`` with the fields);
an unknown table or key raises, naming it and the keys that exist.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tomllib
from typing import Any

__all__ = ["ModelSection", "LayoutSection", "DataSection", "OptimizerSection",
           "CheckpointSection", "EvalSection", "MetricsSection", "TrainConfig", "load_config",
           "config_from_dict"]


@dataclasses.dataclass(kw_only=True)
class ModelSection:
    """``[model]``: a preset of :func:`jaxpg.models.config_for` (``name``) with field
    ``overrides``, or a ``family`` (``llama``, ``qwen3``, ``qwen3_moe``) and all its fields
    in ``overrides``; ``seed`` seeds the initial weights."""

    name: str | None = None
    family: str | None = None
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    seed: int = 0


@dataclasses.dataclass(kw_only=True)
class LayoutSection:
    """``[layout]``: the degrees of :class:`jaxpg.ParallelDims` (``dp_shard``, ``cp``,
    ``tp``), or ``auto = true`` (the planner picks a layout of the devices that fits);
    ``zero`` the FSDP stage, ``sequence_parallel``, ``cp_method`` (``ring`` or
    ``all_to_all``).

    ``pp > 1`` pipelines the model instead: ``pp`` stages times ``dp_replicate``
    data-parallel replicas (0: the devices left over), ``microbatches`` per replica and
    step (0: ``pp``), a ``schedule`` of :func:`jaxpg.pipeline.get_schedule` and its
    ``chunks`` per rank (0: the schedule's own, 2 for the interleaved and V schedules)."""

    auto: bool = False
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    zero: int = 3
    sequence_parallel: bool = False
    cp_method: str = "ring"
    pp: int = 1
    dp_replicate: int = 0
    microbatches: int = 0
    schedule: str = "1f1b"
    chunks: int = 0


@dataclasses.dataclass(kw_only=True)
class DataSection:
    """``[data]``: synthetic token sequences from a seeded generator (``num_sequences`` of
    ``seq_len + 1`` tokens for training, ``eval_sequences`` more for the eval loop),
    ``global_batch`` sequences a step, shuffled per epoch by ``DistributedSampler``."""

    seq_len: int = 64
    global_batch: int = 8
    num_sequences: int = 1024
    eval_sequences: int = 64
    seed: int = 0


@dataclasses.dataclass(kw_only=True)
class OptimizerSection:
    """``[optimizer]``: ``name`` ``adamw`` or ``sgd``; the schedule is ``warmup_cosine``
    (linear warmup to ``lr`` over ``warmup_steps``, cosine to ``end_lr`` at the last step)
    or ``constant``; ``clip_norm`` > 0 clips the global gradient norm first."""

    name: str = "adamw"
    lr: float = 3e-4
    schedule: str = "warmup_cosine"
    warmup_steps: int = 0
    end_lr: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    momentum: float = 0.0
    clip_norm: float = 0.0


@dataclasses.dataclass(kw_only=True)
class CheckpointSection:
    """``[checkpoint]``: save to ``dir`` every ``every`` steps (0: never) and at the end,
    asynchronously with ``async_save``; ``resume`` restores the newest one first."""

    dir: str | None = None
    every: int = 0
    async_save: bool = True
    resume: bool = True


@dataclasses.dataclass(kw_only=True)
class EvalSection:
    """``[eval]``: the mean loss over ``batches`` held-out batches every ``every`` steps
    (0: never)."""

    every: int = 0
    batches: int = 1


@dataclasses.dataclass(kw_only=True)
class MetricsSection:
    """``[metrics]``: ``dir`` gets ``metrics.jsonl`` and (with ``tensorboard``) a
    TensorBoard event file under ``dir/tensorboard``; ``progress`` shows a tqdm bar;
    ``hardware`` names the peak FLOP/s for MFU (a ``jaxpg.plan`` preset, a hardware TOML
    file, or ``calibrate``) at ``dtype``."""

    dir: str | None = None
    tensorboard: bool = False
    progress: bool = True
    hardware: str = "h100-80gb"
    dtype: str = "fp32"


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """The whole config; ``steps`` at the top level (or under ``[train]``)."""

    model: ModelSection
    layout: LayoutSection = dataclasses.field(default_factory=LayoutSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    optimizer: OptimizerSection = dataclasses.field(default_factory=OptimizerSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    metrics: MetricsSection = dataclasses.field(default_factory=MetricsSection)
    steps: int = 10

    def __post_init__(self) -> None:
        checks = [
            (self.steps >= 1, f"steps={self.steps} must be >= 1"),
            (self.optimizer.name in ("adamw", "sgd"),
             f"optimizer.name={self.optimizer.name!r} must be 'adamw' or 'sgd'"),
            (self.optimizer.schedule in ("warmup_cosine", "constant"),
             f"optimizer.schedule={self.optimizer.schedule!r} must be 'warmup_cosine' or "
             "'constant'"),
            (0 <= self.optimizer.warmup_steps <= self.steps,
             f"optimizer.warmup_steps={self.optimizer.warmup_steps} must lie in "
             f"[0, steps={self.steps}]"),
            (self.layout.zero in (1, 2, 3), f"layout.zero={self.layout.zero} must be 1, 2 or 3"),
            (self.layout.cp_method in ("ring", "all_to_all"),
             f"layout.cp_method={self.layout.cp_method!r} must be 'ring' or 'all_to_all'"),
            *_pipeline_checks(self.layout),
            (self.data.seq_len >= 2, f"data.seq_len={self.data.seq_len} must be >= 2"),
            (self.data.global_batch >= 1,
             f"data.global_batch={self.data.global_batch} must be >= 1"),
            (self.data.num_sequences >= self.data.global_batch,
             f"data.num_sequences={self.data.num_sequences} must be >= data.global_batch="
             f"{self.data.global_batch}"),
            (self.eval.every == 0 or self.data.eval_sequences >= self.data.global_batch,
             f"data.eval_sequences={self.data.eval_sequences} must be >= data.global_batch="
             f"{self.data.global_batch} when eval.every > 0"),
            (self.checkpoint.every == 0 or self.checkpoint.dir,
             f"checkpoint.every={self.checkpoint.every} needs checkpoint.dir"),
            (not self.metrics.tensorboard or self.metrics.dir,
             "metrics.tensorboard = true needs metrics.dir"),
            (self.model.name or self.model.family,
             "[model] needs name (a preset, e.g. 'llama3-tiny') or family"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"jaxpg.train config: {message}.")


def _pipeline_checks(lay: LayoutSection) -> list[tuple[bool, str]]:
    """The ``[layout]`` checks of the pipeline keys: what ``pp > 1`` does not combine with."""
    checks = [(lay.pp >= 1, f"layout.pp={lay.pp} must be >= 1"),
              (lay.dp_replicate >= 0, f"layout.dp_replicate={lay.dp_replicate} must be >= 0 "
                                      "(0: the devices the other degrees leave)"),
              (lay.microbatches >= 0, f"layout.microbatches={lay.microbatches} must be >= 0 "
                                      "(0: pp)"),
              (lay.chunks >= 0, f"layout.chunks={lay.chunks} must be >= 0 (0: the "
                                "schedule's own)")]
    if lay.pp == 1:
        checks.append((lay.dp_replicate in (0, 1),
                       f"layout.dp_replicate={lay.dp_replicate} is the pipeline's data-"
                       "parallel degree and needs pp > 1; without a pipeline use dp_shard"))
        return checks
    for key, value, fix in (("cp", lay.cp, "cp = 1"), ("tp", lay.tp, "tp = 1"),
                            ("dp_shard", lay.dp_shard, "dp_replicate for the data-parallel "
                                                       "degree")):
        checks.append((value == 1, f"layout.{key}={value} with pp={lay.pp}: the recipe runs "
                                   f"pipeline stages without tensor, context or sharded "
                                   f"data parallelism inside them; set {fix}, or pp = 1"))
    checks += [(not lay.auto, f"layout.auto = true with pp={lay.pp}: the planner's layouts "
                              "here have no pipeline; give the pipeline degrees or drop pp"),
               (not lay.sequence_parallel, f"layout.sequence_parallel = true with pp={lay.pp} "
                                           "needs tp > 1, which pipeline stages do not take "
                                           "here; set it false")]
    return checks


_SECTIONS = {"model": ModelSection, "layout": LayoutSection, "data": DataSection,
             "optimizer": OptimizerSection, "checkpoint": CheckpointSection,
             "eval": EvalSection, "metrics": MetricsSection}


def _section(cls: type, name: str, table: Any) -> Any:
    if not isinstance(table, dict):
        raise ValueError(f"jaxpg.train config: [{name}] must be a table, got {table!r}.")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"jaxpg.train config: unknown key(s) {unknown} in [{name}]; its "
                         f"keys are {sorted(known)}.")
    return cls(**table)


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """A :class:`TrainConfig` from a parsed TOML document."""
    data = dict(data)
    train = data.pop("train", {})
    steps = data.pop("steps", train.pop("steps", TrainConfig.steps))
    if train:
        raise ValueError(f"jaxpg.train config: unknown key(s) {sorted(train)} in [train]; "
                         "its only key is 'steps'.")
    unknown = sorted(set(data) - set(_SECTIONS))
    if unknown:
        raise ValueError(f"jaxpg.train config: unknown table(s) {unknown}; the tables are "
                         f"{sorted(_SECTIONS)} and [train].")
    if "model" not in data:
        raise ValueError("jaxpg.train config: the [model] table is missing; add "
                         "[model] name = 'llama3-tiny' (a jaxpg.models preset).")
    parts = {k: _section(cls, k, data[k]) for k, cls in _SECTIONS.items() if k in data}
    return TrainConfig(steps=steps, **parts)


def load_config(path: str | pathlib.Path) -> TrainConfig:
    """Reads and validates a TOML config file."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"jaxpg.train: config file {str(path)!r} does not exist.")
    return config_from_dict(tomllib.loads(path.read_text()))
