"""Small models, data and a single-device reference trainer for the DDP tests."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxpg

IN, HIDDEN, OUT = 6, 16, 4


class MLP(nnx.Module):
    """Two dense layers; optionally a BatchNorm between them."""

    def __init__(self, seed=0, batchnorm=False):
        rngs = nnx.Rngs(seed)
        self.l1 = nnx.Linear(IN, HIDDEN, rngs=rngs)
        self.bn = nnx.BatchNorm(HIDDEN, momentum=0.5, rngs=rngs) if batchnorm else None
        self.l2 = nnx.Linear(HIDDEN, OUT, rngs=rngs)

    def __call__(self, x):
        h = self.l1(x)
        if self.bn is not None:
            h = self.bn(h)
        return self.l2(jax.nn.relu(h))


def loss_fn(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def make_batches(steps, global_batch, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.standard_normal((global_batch, IN)).astype(np.float32),
            "y": rng.integers(0, OUT, global_batch).astype(np.int32),
        }
        for _ in range(steps)
    ]


def group(n):
    """The first ``n`` ranks of the 8-rank world as a group (the world itself for 8)."""
    return jaxpg.GroupMember.WORLD if n == 8 else jaxpg.new_group(list(range(n)))


class Reference:
    """Single-device training of an NNX module, the whole batch at once."""

    def __init__(self, model, optimizer, loss=loss_fn):
        self.graphdef, self.params, self.rest = nnx.split(model, nnx.Param, ...)
        self.optimizer = optimizer
        self.opt_state = optimizer.init(self.params)
        graphdef = self.graphdef

        def grads(params, rest, batch):
            def f(p):
                m = nnx.merge(graphdef, p, rest, copy=True)
                value = loss(m, batch)
                return value, nnx.split(m, nnx.Param, ...)[2]

            return jax.value_and_grad(f, has_aux=True)(params)

        self.grads = jax.jit(grads)

    def apply(self, g):
        updates, self.opt_state = self.optimizer.update(g, self.opt_state, self.params)
        self.params = optax.apply_updates(self.params, updates)

    def step(self, batch):
        (value, self.rest), g = self.grads(self.params, self.rest, batch)
        self.apply(g)
        return value


def assert_trees_close(got, want, rtol=1e-5, atol=1e-5):
    got_l, want_l = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_l) == len(want_l)
    for a, b in zip(got_l, want_l, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def zeros_like_tree(tree):
    return jax.tree.map(jnp.zeros_like, tree)
