"""The residual MLP every pipeline benchmark runs, in JAX and in torch.

One definition for ``bench/pipeline.py``, ``bench/_pipeline_mp_worker.py`` (which
``bench/pipeline_efficiency.py`` and ``bench/pipeline_vs_torch.py`` start) and the
studies built on them (``pipeline_breakdown.py``, ``stage_layer_layout.py``,
``action_program_cost.py``, ``mpmd_step_timeline.py``): blocks ``x + W2 gelu(W1 x + b1) +
b2`` of width ``d`` and hidden ``4 d`` (tanh gelu, as jax's and as the torch block uses),
a mean squared error per microbatch, host (numpy) parameters stacked ``[blocks, ...]``.

A stage's parameters are one dict of arrays per block, as a Flax or torch module holds
one ``Linear`` per layer: slicing blocks out of one stacked array inside the step costs a
copy of every weight and a scatter of every gradient (docs/pipeline_mp.md has the
figures, ``python -m bench stage_layer_layout``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def block(w, x):
    """One residual MLP block, ``x + W2 gelu(W1 x + b1) + b2`` (tanh gelu, as jax's)."""
    return x + jax.nn.gelu(x @ w["w1"] + w["b1"]) @ w["w2"] + w["b2"]


@functools.cache
def stage_fn(layers):
    """A stage of ``layers`` blocks over a sequence of ``layers`` per-block dicts."""

    def stage(ws, x):
        assert len(ws) == layers, (len(ws), layers)
        for w in ws:
            x = block(w, x)
        return x

    return stage


def mse(_, y, t):
    """The last stage's loss of a microbatch (no head parameters)."""
    return jnp.mean((y - t) ** 2)


def make_params(blocks, d, seed=0):
    """Host (numpy) parameters of ``blocks`` blocks, stacked ``[blocks, ...]``."""
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    params = {
        "w1": jax.random.normal(k1, (blocks, d, 4 * d)) / np.sqrt(d),
        "b1": 0.1 * jax.random.normal(k3, (blocks, 4 * d)),
        "w2": jax.random.normal(k2, (blocks, 4 * d, d)) / np.sqrt(4 * d),
        "b2": 0.1 * jax.random.normal(k4, (blocks, d)),
    }
    return {k: np.asarray(v, np.float32) for k, v in params.items()}


def make_batch(rows, d, seed=1):
    """``(x, t)``: the inputs and targets, float32 ``(rows, d)`` each, on the host."""
    kx, kt = jax.random.split(jax.random.key(seed))
    return (np.asarray(jax.random.normal(kx, (rows, d)), np.float32),
            np.asarray(jax.random.normal(kt, (rows, d)), np.float32))  # fmt: skip


def per_block(params):
    """``{k: [blocks, ...]}`` -> one dict per block (the un-pipelined model's parameters)."""
    blocks = len(next(iter(params.values())))
    return [{k: a[i] for k, a in params.items()} for i in range(blocks)]


def staged(params, stages):
    """``{k: [blocks, ...]}`` -> the stages' parameters in model order: a list of
    ``blocks / stages`` dicts (a stage's layers), each leaf ``[stages, ...]`` (block
    ``s * layers + i`` is entry ``i`` of stage ``s``)."""
    out = {k: a.reshape(stages, -1, *a.shape[1:]) for k, a in params.items()}
    layers = next(iter(out.values())).shape[1]
    return [{k: a[:, j] for k, a in out.items()} for j in range(layers)]


def unstaged(stage_params):
    """The inverse of ``staged`` (host or device arrays): ``{k: [blocks, ...]}`` on the host,
    in model order."""
    return {k: np.stack([np.asarray(layer[k]) for layer in stage_params], axis=1).reshape(
        -1, *np.shape(stage_params[0][k])[1:]) for k in stage_params[0]}  # fmt: skip


def stacked(layer_params):
    """One dict per block (host or device arrays) -> ``{k: [blocks, ...]}`` on the host."""
    return {k: np.stack([np.asarray(w[k]) for w in layer_params]) for k in layer_params[0]}


def torch_block(d=None, w=None):
    """The same block as a ``torch.nn.Module`` (torch imported on call): with ``w`` (one
    block's host parameters) holding exactly those weights, else of width ``d`` with
    torch's own initialization."""
    import torch

    class Block(torch.nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.up, self.down = torch.nn.Linear(d, h), torch.nn.Linear(h, d)

        def forward(self, x):
            gelu = torch.nn.functional.gelu(self.up(x), approximate="tanh")
            return x + self.down(gelu)

    if w is None:
        return Block(d, 4 * d)
    module = Block(*w["w1"].shape)
    with torch.no_grad():
        module.up.weight.copy_(torch.from_numpy(w["w1"].T.copy()))
        module.up.bias.copy_(torch.from_numpy(w["b1"].copy()))
        module.down.weight.copy_(torch.from_numpy(w["w2"].T.copy()))
        module.down.bias.copy_(torch.from_numpy(w["b2"].copy()))
    return module
