"""The models, layouts and rank correlation of ``python -m bench planner`` and its
multi-process worker (no jax flags set here: each process sets its own devices)."""

from __future__ import annotations

import numpy as np

from jaxpg.plan import TransformerSpec

GPT = TransformerSpec(layers=2, dim=128, heads=8, ffn=512, vocab=512, mlp="gelu",
                      flash_attention=False, tied_embeddings=True, name="bench-gpt")
LAYOUTS = [
    "dp_replicate=8,microbatches=1",
    "dp_replicate=8,microbatches=1,remat=full",
    "dp_replicate=8,microbatches=2",
    "dp_replicate=8,microbatches=1,remat=selective",
    "dp_shard=8,microbatches=1,zero=1",
    "dp_shard=8,microbatches=1,zero=3",
    "dp_replicate=4,tp=2,microbatches=1",
    "dp_replicate=2,tp=4,microbatches=1",
    "tp=8,microbatches=1",
    "dp_replicate=2,tp=4,microbatches=1,remat=full",
    "dp_shard=4,tp=2,microbatches=1,zero=3",
    "tp=8,microbatches=2,remat=full",
]
MOE = TransformerSpec(layers=2, dim=128, heads=8, ffn=512, vocab=512, mlp="gelu",
                      flash_attention=False, tied_embeddings=True, experts=8, top_k=2,
                      expert_ffn=256, name="bench-moe")
MOE_LAYOUTS = [  # MoE trials run tp = 1; ep borrows its ranks from dp_shard
    "dp_replicate=8,microbatches=1",
    "dp_replicate=8,microbatches=2",
    "dp_replicate=8,microbatches=1,remat=full",
    "dp_shard=8,microbatches=1,zero=1",
    "dp_shard=8,microbatches=1,zero=3",
    "dp_shard=8,ep=2,microbatches=1,zero=1",
    "dp_shard=8,ep=4,microbatches=1,zero=1",
    "dp_shard=8,ep=8,microbatches=1,zero=1",
    "dp_shard=8,ep=8,microbatches=2,zero=1",
    "dp_shard=8,ep=4,microbatches=1,zero=3",
    "dp_shard=8,ep=2,microbatches=1,remat=full,zero=1",
    "dp_replicate=2,dp_shard=4,ep=4,microbatches=1,zero=1",
]
MODELS = {"gpt": (GPT, LAYOUTS), "moe": (MOE, MOE_LAYOUTS)}
# Across processes: the same layouts but those with both dp_replicate and dp_shard (the
# trials shard ZeRO over every data-parallel rank, the planner over dp_shard's only, which
# the processes would tell apart)
MP_LAYOUTS = {name: [text for text in layouts
                     if not ("dp_replicate" in text and "dp_shard" in text)]
              for name, (_, layouts) in MODELS.items()}


def ranks(values) -> list[int]:
    """Each value's rank, 1 for the smallest (ties in order of appearance)."""
    order = np.argsort(np.asarray(values), kind="stable")
    out = np.empty(len(values), dtype=int)
    out[order] = np.arange(1, len(values) + 1)
    return out.tolist()


def spread(values) -> dict:
    """The median, least and most of ``values``."""
    return {"median": float(np.median(values)), "min": min(values), "max": max(values)}


def spearman(a, b) -> float:
    """Spearman's rank correlation (no ties expected)."""
    ra, rb = ranks(a), ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])


def time_in_rounds(trials, rounds: int) -> list[list[tuple[float, float]]]:
    """Each trial's ``(wall, cpu)`` seconds of ``rounds`` steps, after a warm-up step each:
    every round runs one step of each trial, starting one further on each round, so that
    the machine's drift over the run falls on every layout alike."""
    for trial in trials:
        trial.step()
    samples = [[] for _ in trials]
    for r in range(rounds):
        for i in [(r + k) % len(trials) for k in range(len(trials))]:
            samples[i].append(trials[i].step())
    return samples


def summary(rows: list[dict]) -> dict:
    """Spearman's rank correlation of the rows' predicted against measured seconds, the
    predicted pick against the best measured, and the predicted over measured seconds."""
    predicted = [r["predicted_s"] for r in rows]
    measured = [r["measured_s"] for r in rows]
    pick = int(np.argmin(predicted))
    ratios = [p / m for p, m in zip(predicted, measured)]
    return {"spearman": spearman(predicted, measured), "top_pick": rows[pick]["layout"],
            "top_pick_over_best_measured": measured[pick] / min(measured),
            "predicted_over_measured": spread(ratios)}
