"""A pipeline stage's pieces, each its own jitted program on one device, for
``bench/gpu.py`` and ``bench/zb_split_cost.py``: the forward ``F``, the whole
backward, and a split backward's ``B`` and ``W`` (``jaxpg.pipeline.stage.split``) of one
residual block ``x + W2 tanh(W1 x + b1) + b2``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpg.pipeline.stage import split as stage_split


def block(p, x):
    return x + jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def piece_variants(dim: int, rows: int) -> dict:
    """``{piece: zero-argument call}`` for ``F``, ``B whole``, ``B split`` and ``W`` of the
    block at width ``dim`` on ``rows`` rows, each compiled and run once."""
    k = jax.random.split(jax.random.key(1), 3)
    p = {"w1": jax.random.normal(k[0], (dim, dim)) / dim**0.5, "b1": jnp.zeros(dim),
         "w2": jax.random.normal(k[1], (dim, dim)) / dim**0.5, "b2": jnp.zeros(dim)}
    x = jax.random.normal(k[2], (rows, dim))
    whole = stage_split.split_stage(block, p, x, False)
    split = stage_split.split_stage(block, p, x, True)
    forward, backward = jax.jit(whole.forward), jax.jit(whole.backward)
    b_split, weight = jax.jit(split.backward), jax.jit(split.weight)
    _, res = forward(p, x)
    _, _, wres = b_split(p, x, x, res)
    return {"F": lambda: forward(p, x), "B whole": lambda: backward(p, x, x, res),
            "B split": lambda: b_split(p, x, x, res),
            "W": lambda: weight(p, x, x, res, wres)}
