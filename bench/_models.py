"""The 25M-parameter MLP the DDP and throughput benchmarks train, in Flax NNX and torch.

One definition for ``bench/ddp.py``, ``bench/_throughput_ddp_worker.py``, ``bench/gpu.py``
and (with other ``layers``) ``bench/layouts.py``: layers ``1024 -> 4096 -> 4096 -> 1024 ->
10`` with ReLU between them, softmax cross-entropy on integer labels, a standard-normal
batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
import optax
from flax import nnx

LAYERS = (1024, 4096, 4096, 1024, 10)


class MLP(nnx.Module):
    """Dense layers with ReLU between them (``layers``: the widths, input first)."""

    def __init__(self, rngs: nnx.Rngs, layers: Sequence[int] = LAYERS):
        self.layers = nnx.List(
            [nnx.Linear(a, b, rngs=rngs) for a, b in zip(layers[:-1], layers[1:], strict=True)]
        )

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


def loss_fn(model, batch):
    """Mean softmax cross-entropy of ``model(batch['x'])`` against ``batch['y']``."""
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def local_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation):
    """The un-jitted step without communication: ``(params, opt_state, batch) -> (params,
    opt_state)``, forward and backward of :func:`loss_fn` on ``nnx.merge(graphdef,
    params)``, then ``tx``'s update."""

    def step(params, opt_state, batch):
        def loss(p):
            return loss_fn(nnx.merge(graphdef, p), batch)

        grads = jax.grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def n_params(layers: Sequence[int] = LAYERS) -> int:
    """The number of parameters (weights and biases)."""
    return sum(a * b + b for a, b in zip(layers[:-1], layers[1:], strict=True))


def make_batch(rows: int, seed: int = 0, layers: Sequence[int] = LAYERS) -> dict:
    """``{'x': float32 (rows, layers[0]), 'y': int32 labels in [0, layers[-1])}``."""
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((rows, layers[0])).astype(np.float32),
        "y": rng.integers(0, layers[-1], rows).astype(np.int32),
    }


def torch_mlp(layers: Sequence[int] = LAYERS):
    """The same MLP as a ``torch.nn.Sequential`` (torch imported on call)."""
    import torch

    mods: list = []
    for a, b in zip(layers[:-1], layers[1:], strict=True):
        mods += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods[:-1])
