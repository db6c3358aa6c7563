"""The small model of the DDP expert-parallel checks (``test_ep_ddp.py`` and
``workers/moe_worker.py``): a dense layer, then a mixture of experts, and its loss."""

import jax.numpy as jnp
from flax import nnx

from jaxpg.expert_parallel import MoELayer

D, F, E = 8, 16, 8


class Net(nnx.Module):
    def __init__(self, group, rngs):
        self.inp = nnx.Linear(D, D, rngs=rngs)
        self.moe = MoELayer(D, F, E, top_k=2, group=group, rngs=rngs)

    def __call__(self, x):
        return self.moe(jnp.tanh(self.inp(x)))


def loss_fn(model, batch):
    x, target = batch
    return jnp.mean((model(x) - target) ** 2)
