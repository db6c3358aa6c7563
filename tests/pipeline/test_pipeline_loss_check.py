"""A pipeline loss that cannot train is named before anything runs: make_train_step's
``loss_fn(last_params, y, targets)`` that uses neither, and a schedule's
``loss_fn(output, target)`` that ignores the stage's output."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

from jaxpg.data_parallel.loss_check import LossDoesNotTrainError
from jaxpg.pipeline import PipelineStage
from jaxpg.pipeline.api import StagedParams
from jaxpg.pipeline.train_step import init_train_state, make_train_step

pytestmark = pytest.mark.cpu_only


def _block(p, x):
    return x + jnp.tanh(x @ p["w"])


def test_make_train_step_names_a_loss_that_ignores_its_arguments():
    stages = {"w": 0.1 * jax.random.normal(jax.random.key(0), (2, 4, 4))}
    head = {"v": jnp.ones((4, 3))}
    params = StagedParams(stages, (), head)
    x, t = jnp.ones((4, 4)), jnp.zeros((4, 3))
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("dp", "pp"))
    closed = jnp.ones((2, 3))  # a microbatch's output computed outside: the torch habit

    def ignores(lp, y, t):
        return jnp.mean((closed - t) ** 2)

    optimizer = optax.sgd(0.1)
    placed, state = init_train_state(params, optimizer, mesh)
    step = make_train_step(_block, ignores, optimizer, mesh=mesh, num_microbatches=2)
    with pytest.raises(LossDoesNotTrainError,
                       match=r"pipeline: loss_fn 'test_make_train_step.*ignores' .*does not "
                             r"depend on last_params or y.*closes over a module"):
        step(placed, state, x, t)

    def trains(lp, y, t):  # the head's parameters and the last stage's output
        return jnp.mean((y @ lp["v"] - t) ** 2)

    step = make_train_step(_block, trains, optimizer, mesh=mesh, num_microbatches=2)
    _, _, loss = step(placed, state, x, t)
    assert jnp.isfinite(loss)


class _Linear(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return jnp.tanh(self.lin(x))


def test_a_schedule_loss_that_ignores_the_stage_output_is_named(world):
    from jaxpg.pipeline.process.stage_runner import stage_programs

    module = _Linear()
    stage = PipelineStage(module, 7, 8)
    x, t = jnp.ones((2, 4)), jnp.zeros((2, 4))
    p, rest = stage.placed(stage.params()), stage.placed(stage.frozen_state())
    progs = stage_programs(stage, lambda out, t: jnp.mean((module(x) - t) ** 2))
    with pytest.raises(LossDoesNotTrainError,
                       match=r"PipelineStage schedule: loss_fn .* does not depend on its "
                             r"output argument.*closes over the module"):
        progs.forward_loss(p, rest, (x,), t)
    good = stage_programs(stage, lambda out, t: jnp.mean((out - t) ** 2))
    loss, _, _ = good.forward_loss(p, rest, (x,), t)
    assert float(loss) > 0
