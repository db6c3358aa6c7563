"""The training loop of ``python -m jaxpg.train``: a ``jaxpg.models`` model laid out with
FSDP x TP x CP on one :class:`~jaxpg.ParallelDims`, trained by
:class:`~jaxpg.fsdp.FullyShardedDataParallel`'s ``train_step`` on synthetic tokens.

The model is laid out with :func:`jaxpg.models.parallelize` (``fsdp=False``: the tp split
and the cp attention), and FSDP shards the rest over ``dp_shard x cp`` with
``context_parallel=`` splitting the tokens, targets and their global positions along the
sequence. Each step records the loss and ``grad_norm`` (from the step itself), the
learning rate, the step time, tokens/s, MFU and memory; every ``eval.every`` steps the
mean loss of held-out batches (the gathered model's host call); every ``checkpoint.every``
steps an (asynchronous) sharded checkpoint, from which a run resumes.

With ``[layout] pp > 1`` the model is pipelined instead (:mod:`jaxpg.train.pipelined`):
its decoder layers stacked by stage on ``ParallelDims(dp_replicate=..., pp=...)``, one
jitted step of the pipeline executor, the same metrics, eval loop and checkpoints (of the
stacked state, :mod:`jaxpg.train.pytree_checkpoint`).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxpg.fsdp import FullyShardedDataParallel
from jaxpg.fsdp import checkpoint as fsdp_checkpoint
from jaxpg.groups.parallel_dims import ParallelDims
from jaxpg.models import CausalLM, config_for, parallelize
from jaxpg.models.config import PRESETS, LlamaConfig, Qwen3Config, Qwen3MoeConfig
from jaxpg.train import pytree_checkpoint
from jaxpg.train.config import TrainConfig
from jaxpg.train.data import EVAL_SEED_OFFSET, StepBatches, synthetic_sequences
from jaxpg.train.metrics_log import MetricsLog
from jaxpg.train.pipelined import PipelinedLM, chunks_of
from jaxpg.train.throughput import memory_in_use, model_spec, resolve_hardware

__all__ = ["model_config", "choose_degrees", "make_optimizer", "loss_fn", "train"]

_FAMILIES = {"llama": LlamaConfig, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}


def model_config(cfg: TrainConfig) -> Any:
    """The ``jaxpg.models`` config that ``[model]`` names."""
    section = cfg.model
    if section.name is not None:
        if section.name not in PRESETS:
            raise ValueError(f"jaxpg.train config: model.name={section.name!r} is not a "
                             f"preset; the presets are {sorted(PRESETS)}.")
        return config_for(section.name, **section.overrides)
    if section.family not in _FAMILIES:
        raise ValueError(f"jaxpg.train config: model.family={section.family!r} must be one "
                         f"of {sorted(_FAMILIES)}.")
    return _FAMILIES[section.family](**section.overrides)


def choose_degrees(cfg: TrainConfig, config: Any, devices: int) -> dict[str, int]:
    """``{"dp_shard", "cp", "tp"}``: the config's, or with ``auto`` the planner's fastest
    layout of ``devices`` that fits and that the recipe runs (no pipeline, no replicas, no
    expert parallelism)."""
    lay = cfg.layout
    if not lay.auto:
        degrees = {"dp_shard": lay.dp_shard, "cp": lay.cp, "tp": lay.tp}
        if np.prod(list(degrees.values())) != devices:
            raise ValueError(f"jaxpg.train config: layout dp_shard x cp x tp = "
                             f"{lay.dp_shard} x {lay.cp} x {lay.tp} must equal the "
                             f"{devices} devices; change the degrees or set auto = true.")
        return degrees
    from jaxpg import plan

    job = plan.Job(model=model_spec(config), devices=devices,
                   hardware=resolve_hardware(cfg.metrics.hardware),
                   seq_len=cfg.data.seq_len, global_batch=cfg.data.global_batch,
                   dtype=cfg.metrics.dtype)
    for est in plan.search(job):
        got = est.layout
        if got.pp == 1 and got.ep == 1 and got.dp_replicate == 1:
            return {"dp_shard": got.dp_shard, "cp": got.cp, "tp": got.tp}
    raise ValueError(f"jaxpg.train: the planner found no dp_shard x cp x tp layout of "
                     f"{devices} devices that fits this model with seq_len="
                     f"{cfg.data.seq_len} and global_batch={cfg.data.global_batch}; give "
                     "the degrees in [layout].")


def make_optimizer(cfg: TrainConfig) -> tuple[optax.GradientTransformation, Any]:
    """``(optimizer, schedule)`` of ``[optimizer]`` over ``cfg.steps`` steps."""
    o = cfg.optimizer
    if o.schedule == "constant":
        schedule = optax.constant_schedule(o.lr)
    else:
        schedule = optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=o.lr, warmup_steps=o.warmup_steps,
            decay_steps=cfg.steps, end_value=o.end_lr)
    if o.name == "adamw":
        tx = optax.adamw(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay)
    else:
        tx = optax.sgd(schedule, momentum=o.momentum or None)
    if o.clip_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(o.clip_norm), tx)
    return tx, schedule


def loss_fn(model: Any, batch: dict[str, Any]) -> jax.Array:
    """The mean next-token cross-entropy over this rank's tokens (at global positions)."""
    logits = model(batch["tokens"], batch["positions"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["targets"]).mean()


def _process_ranks(dp: int) -> list[int]:
    """The data-parallel ranks whose samples this process feeds (contiguous per process)."""
    n, p = jax.process_count(), jax.process_index()
    if n == 1:
        return list(range(dp))
    if dp % n:
        raise ValueError(f"jaxpg.train: the data-parallel degree {dp} must be a multiple of "
                         f"the {n} processes.")
    k = dp // n
    return list(range(p * k, (p + 1) * k))


@dataclasses.dataclass
class _Run:
    trainer: Any
    train_data: StepBatches
    eval_data: StepBatches | None
    schedule: Any
    flops_per_token: float
    peak_flops: float


class _FsdpTrainer:
    """The FSDP x TP x CP path: :class:`FullyShardedDataParallel`'s step and checkpoints."""

    def __init__(self, model: Any, tx: optax.GradientTransformation, dims: ParallelDims,
                 cfg: TrainConfig, cp: int):
        self.graphdef = nnx.graphdef(model)
        self.fsdp = FullyShardedDataParallel(model, tx, group=dims["dp_shard_cp"],
                                             zero_stage=cfg.layout.zero,
                                             context_parallel=dims if cp > 1 else None)

    def train_step(self, batch: dict[str, Any]) -> tuple[float, float]:
        out = self.fsdp.train_step(loss_fn, batch)
        return float(out["loss"]), float(out["grad_norm"])

    def eval_loss(self, batch: dict[str, Any]) -> float:
        model = nnx.merge(self.graphdef, self.fsdp.full_params(), self.fsdp.rest)
        logits = jnp.asarray(model(batch["tokens"]), jnp.float32)
        return float(optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["targets"]).mean())

    def restore(self, directory: str) -> int:
        fsdp_checkpoint.restore_checkpoint(directory, self.fsdp)
        return self.fsdp.step

    def save(self, directory: str, step: int, async_save: bool) -> None:
        fsdp_checkpoint.save_checkpoint(directory, self.fsdp, data_state={"step": step},
                                        async_save=async_save)


class _PipelineTrainer:
    """The pipelined path: :class:`~jaxpg.train.pipelined.PipelinedLM`, its state saved as
    a pytree checkpoint."""

    def __init__(self, model: Any, tx: optax.GradientTransformation, dims: ParallelDims,
                 cfg: TrainConfig):
        lay = cfg.layout
        self.lm = PipelinedLM(model, tx, dims, schedule=lay.schedule,
                              microbatches=lay.microbatches or lay.pp,
                              chunks=chunks_of(lay.schedule, lay.chunks))
        self.step = 0

    def train_step(self, batch: dict[str, Any]) -> tuple[float, float]:
        self.step += 1
        return self.lm.train_step(batch)

    def eval_loss(self, batch: dict[str, Any]) -> float:
        return self.lm.eval_loss(batch)

    def restore(self, directory: str) -> int:
        self.step, state = pytree_checkpoint.restore_tree(directory, self.lm.state())
        self.lm.load_state(state)
        return self.step

    def save(self, directory: str, step: int, async_save: bool) -> None:
        pytree_checkpoint.save_tree(directory, step, self.lm.state(),
                                    data_state={"step": step}, async_save=async_save)


def _pipeline_degrees(cfg: TrainConfig, devices: int) -> dict[str, int]:
    lay = cfg.layout
    if jax.process_count() > 1:
        raise ValueError(f"jaxpg.train: layout.pp={lay.pp} runs in one process (its devices "
                         f"all local); this run has {jax.process_count()} processes. Start "
                         "one process with all the devices, or set pp = 1.")
    dp = lay.dp_replicate or devices // lay.pp
    if dp * lay.pp != devices:
        raise ValueError(f"jaxpg.train config: layout pp x dp_replicate = {lay.pp} x "
                         f"{lay.dp_replicate or devices / lay.pp:g} must equal the {devices} "
                         "devices; change the degrees (dp_replicate = 0 takes the rest).")
    m = lay.microbatches or lay.pp
    if cfg.data.global_batch % (dp * m):
        raise ValueError(f"jaxpg.train config: data.global_batch={cfg.data.global_batch} "
                         f"must be a multiple of dp_replicate x microbatches = {dp} x {m}; "
                         "change one of them.")
    return {"dp_replicate": dp, "pp": lay.pp}


def _build(cfg: TrainConfig) -> _Run:
    config = model_config(cfg)
    devices = jax.device_count()
    pipelined = cfg.layout.pp > 1
    degrees = (_pipeline_degrees(cfg, devices) if pipelined
               else choose_degrees(cfg, config, devices))
    dims = ParallelDims(**degrees)
    model = CausalLM(config, rngs=nnx.Rngs(cfg.model.seed))
    tx, schedule = make_optimizer(cfg)
    if pipelined:
        trainer: Any = _PipelineTrainer(model, tx, dims, cfg)
        dp = degrees["dp_replicate"]
    else:
        parallelize(model, dims, fsdp=False, sequence_parallel=cfg.layout.sequence_parallel,
                    cp_method=cfg.layout.cp_method)
        trainer = _FsdpTrainer(model, tx, dims, cfg, degrees["cp"])
        dp = degrees["dp_shard"]
    d = cfg.data
    ranks = _process_ranks(dp)
    train_data = StepBatches(synthetic_sequences(d.num_sequences, d.seq_len + 1,
                                                 config.vocab_size, d.seed),
                             global_batch=d.global_batch, dp=dp, ranks=ranks, seed=d.seed)
    eval_data = None
    if cfg.eval.every:
        held_out = synthetic_sequences(d.eval_sequences, d.seq_len + 1, config.vocab_size,
                                       d.seed + EVAL_SEED_OFFSET)
        eval_data = StepBatches(held_out, global_batch=d.global_batch, dp=1, ranks=[0],
                                seed=d.seed, shuffle=False)
    hardware = resolve_hardware(cfg.metrics.hardware)
    if jax.process_index() == 0:
        chosen = " x ".join(f"{k} {v}" for k, v in degrees.items())
        how = (f", {cfg.layout.schedule} with {cfg.layout.microbatches or cfg.layout.pp} "
               "microbatches" if pipelined else "")
        print(f"jaxpg.train: {type(config).__name__} on {devices} devices, {chosen}{how}"
              f"{' (the planner)' if cfg.layout.auto else ''}", file=sys.stderr)
    return _Run(trainer, train_data, eval_data, schedule,
                model_spec(config).train_flops_per_token(d.seq_len),
                hardware.peak_flops(cfg.metrics.dtype) * devices)


def _eval_loss(run: _Run, batches: int) -> float:
    return sum(run.trainer.eval_loss(run.eval_data.batch(i)) for i in range(batches)) / batches


def train(cfg: TrainConfig) -> list[dict[str, Any]]:
    """Runs the recipe to ``cfg.steps`` steps; returns every record it logged.

    Call it on every process (after ``jaxpg.init_process_group()`` when there are several).
    """
    run = _build(cfg)
    ck = cfg.checkpoint
    start = 0
    if ck.dir and ck.resume and fsdp_checkpoint.latest_step(ck.dir) is not None:
        start = run.trainer.restore(ck.dir)
    log = MetricsLog(cfg.metrics.dir, tensorboard=cfg.metrics.tensorboard,
                     progress=cfg.metrics.progress, total=cfg.steps, initial=start,
                     enabled=jax.process_index() == 0)
    tokens = cfg.data.global_batch * cfg.data.seq_len
    records = []
    try:
        for step in range(start, cfg.steps):
            lr = float(run.schedule(step))
            t0 = time.perf_counter()
            loss, grad_norm = run.trainer.train_step(run.train_data.batch(step))
            seconds = time.perf_counter() - t0
            mem, source = memory_in_use()
            rate = tokens / seconds
            record = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "step_time_s": seconds,
                      "tokens_per_s": rate, "mfu": rate * run.flops_per_token / run.peak_flops,
                      "memory_bytes": mem, "memory_source": source}
            done = step + 1
            log.log(done, record)
            records.append({"step": done, "kind": "train", **record})
            if cfg.eval.every and done % cfg.eval.every == 0:
                ev = {"loss": _eval_loss(run, cfg.eval.batches)}
                log.log(done, ev, kind="eval")
                records.append({"step": done, "kind": "eval", **ev})
            if ck.dir and ((ck.every and done % ck.every == 0) or done == cfg.steps):
                run.trainer.save(ck.dir, done, ck.async_save)
        if ck.dir:
            fsdp_checkpoint.wait_for_checkpoints()
    finally:
        log.close()
    return records
