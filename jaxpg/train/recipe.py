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
from jaxpg.train.config import TrainConfig
from jaxpg.train.data import EVAL_SEED_OFFSET, StepBatches, synthetic_sequences
from jaxpg.train.metrics_log import MetricsLog
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
    fsdp: FullyShardedDataParallel
    graphdef: Any
    train_data: StepBatches
    eval_data: StepBatches | None
    schedule: Any
    flops_per_token: float
    peak_flops: float


def _build(cfg: TrainConfig) -> _Run:
    config = model_config(cfg)
    devices = jax.device_count()
    degrees = choose_degrees(cfg, config, devices)
    dims = ParallelDims(**degrees)
    model = CausalLM(config, rngs=nnx.Rngs(cfg.model.seed))
    parallelize(model, dims, fsdp=False, sequence_parallel=cfg.layout.sequence_parallel,
                cp_method=cfg.layout.cp_method)
    graphdef = nnx.graphdef(model)
    tx, schedule = make_optimizer(cfg)
    fsdp = FullyShardedDataParallel(model, tx, group=dims["dp_shard_cp"],
                                    zero_stage=cfg.layout.zero,
                                    context_parallel=dims if degrees["cp"] > 1 else None)
    d = cfg.data
    dp, ranks = degrees["dp_shard"], _process_ranks(degrees["dp_shard"])
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
        print(f"jaxpg.train: {type(config).__name__} on {devices} devices, {chosen}"
              f"{' (the planner)' if cfg.layout.auto else ''}", file=sys.stderr)
    return _Run(fsdp, graphdef, train_data, eval_data, schedule,
                model_spec(config).train_flops_per_token(d.seq_len),
                hardware.peak_flops(cfg.metrics.dtype) * devices)


def _eval_loss(run: _Run, batches: int) -> float:
    model = nnx.merge(run.graphdef, run.fsdp.full_params(), run.fsdp.rest)
    total = 0.0
    for i in range(batches):
        b = run.eval_data.batch(i)
        logits = jnp.asarray(model(b["tokens"]), jnp.float32)
        total += float(optax.softmax_cross_entropy_with_integer_labels(
            logits, b["targets"]).mean())
    return total / batches


def train(cfg: TrainConfig) -> list[dict[str, Any]]:
    """Runs the recipe to ``cfg.steps`` steps; returns every record it logged.

    Call it on every process (after ``jaxpg.init_process_group()`` when there are several).
    """
    run = _build(cfg)
    ck = cfg.checkpoint
    if ck.dir and ck.resume and fsdp_checkpoint.latest_step(ck.dir) is not None:
        fsdp_checkpoint.restore_checkpoint(ck.dir, run.fsdp)
    start = run.fsdp.step
    log = MetricsLog(cfg.metrics.dir, tensorboard=cfg.metrics.tensorboard,
                     progress=cfg.metrics.progress, total=cfg.steps, initial=start,
                     enabled=jax.process_index() == 0)
    tokens = cfg.data.global_batch * cfg.data.seq_len
    records = []
    try:
        for step in range(start, cfg.steps):
            lr = float(run.schedule(step))
            t0 = time.perf_counter()
            out = run.fsdp.train_step(loss_fn, run.train_data.batch(step))
            loss, grad_norm = float(out["loss"]), float(out["grad_norm"])
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
                fsdp_checkpoint.save_checkpoint(ck.dir, run.fsdp, data_state={"step": done},
                                                async_save=ck.async_save)
        if ck.dir:
            fsdp_checkpoint.wait_for_checkpoints()
    finally:
        log.close()
    return records
