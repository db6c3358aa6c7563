"""A small model with odd sizes, data, and one-device reference trainers for the FSDP tests.

The model has every kind of parameter FSDP must pad: kernels whose dim 0 does not divide
by the group (7, 12, 5 rows), a (1, H) parameter smaller than the group and a scalar.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxpg

IN, HIDDEN, OUT = 7, 12, 5


class Block(nnx.Module):
    """A residual tanh layer: one FSDP unit."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(HIDDEN, HIDDEN, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.lin(x))


class Net(nnx.Module):
    def __init__(self, seed=0, depth=2):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Linear(IN, HIDDEN, rngs=rngs)
        self.pos = nnx.Param(0.1 * jax.random.normal(rngs.params(), (1, HIDDEN)))
        self.blocks = nnx.List([Block(rngs) for _ in range(depth)])
        self.head = nnx.Linear(HIDDEN, OUT, rngs=rngs)
        self.scale = nnx.Param(jnp.float32(1.5))

    def __call__(self, x):
        h = self.embed(x) + self.pos[...]
        for block in self.blocks:
            h = block(h)
        return self.head(h) * self.scale[...]


def loss_fn(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def make_batches(steps, global_batch, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((global_batch, IN)).astype(np.float32),
             "y": rng.integers(0, OUT, global_batch).astype(np.int32)} for _ in range(steps)]


def group(n):
    """The first ``n`` ranks of the world as a group (the world itself when it has n)."""
    world = jaxpg.GroupMember.WORLD
    return world if n == world.size() else jaxpg.new_group(list(range(n)))


class Reference:
    """One-device training on the whole batch, with an optional mixed-precision policy.

    With a policy, the step computes each of ``n`` ranks' gradients on its slice (in
    ``param_dtype``), casts them to ``reduce_dtype``, averages them, and casts the average
    to the parameters' dtype: what every FSDP rank does, one rank at a time.
    """

    def __init__(self, model, optimizer, *, policy=None, n=1):
        self.graphdef, self.params = nnx.split(model, nnx.Param)
        self.optimizer, self.policy, self.n = optimizer, policy, n
        self.opt_state = optimizer.init(self.params)
        graphdef = self.graphdef

        def grads(params, batch):
            def f(p):
                if policy is not None and policy.param_dtype is not None:
                    p = jax.tree.map(lambda x: x.astype(policy.param_dtype), p)
                    batch_ = {**batch, "x": batch["x"].astype(policy.param_dtype)}
                else:
                    batch_ = batch
                return loss_fn(nnx.merge(graphdef, p), batch_)

            return jax.grad(f)(params)

        self.grads = jax.jit(grads)

    def step(self, batch):
        if self.policy is None:
            g = self.grads(self.params, batch)
        else:
            rd = self.policy.reduce_dtype or self.policy.param_dtype
            size = batch["x"].shape[0] // self.n
            parts = [self.grads(self.params, jax.tree.map(lambda a, r=r: a[r * size:(r + 1) * size],
                                                           batch)) for r in range(self.n)]
            g = _average(parts, self.params, rd)
        self.params, self.opt_state = _apply(self.optimizer, g, self.opt_state, self.params)


@functools.partial(jax.jit, static_argnums=2)
def _average(parts, params, reduce_dtype):
    """The ranks' gradients, averaged in ``reduce_dtype``, in the parameters' dtypes."""
    g = jax.tree.map(lambda *gs: sum(x.astype(reduce_dtype) for x in gs) / len(gs), *parts)
    return jax.tree.map(lambda x, p: x.astype(p.dtype), g, params)


@functools.partial(jax.jit, static_argnums=0)
def _apply(optimizer, grads, opt_state, params):
    """One optimizer update, as one program (each test process compiles it once)."""
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def assert_trees_close(got, want, rtol=1e-5, atol=1e-5):
    got_l, want_l = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_l) == len(want_l)
    for a, b in zip(got_l, want_l, strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=rtol, atol=atol)
