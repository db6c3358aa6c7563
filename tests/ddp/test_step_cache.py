"""Compiled steps are cached by a loss function's code and closure, not its identity: a fresh
lambda of the same code each step reuses the step (DDP, FSDP, the pipeline), gives the same
training as one function reused, and a closure that really changes warns once."""

import functools

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _ddp_models import MLP, Reference, assert_trees_close, group, loss_fn, make_batches

from jaxpg.data_parallel.step_cache import (
    RECOMPILE_WARNING_AFTER,
    StepCache,
    code_keyed,
    function_key,
)
from jaxpg.ddp import DistributedDataParallel


def _scaled(scale):
    return lambda x: x * scale


def test_function_key_equal_for_the_same_code_and_closure_values():
    assert function_key(_scaled(2.0)) == function_key(_scaled(2.0))
    assert hash(function_key(_scaled(2.0))) == hash(function_key(_scaled(2.0)))
    assert function_key(_scaled(2.0)) != function_key(_scaled(3.0))
    assert function_key(_scaled(1)) != function_key(_scaled(1.0))  # they trace differently
    assert function_key(_scaled((1, "a"))) == function_key(_scaled((1, "a")))
    # other code, same closure: different
    assert function_key(lambda x: x + 1) != function_key(lambda x: x + 1)


def test_function_key_compares_other_objects_by_identity():
    a, b = np.ones(3), np.ones(3)
    assert function_key(_scaled(a)) == function_key(_scaled(a))
    assert function_key(_scaled(a)) != function_key(_scaled(b))  # equal values, other arrays


def test_function_key_of_nested_functions_partials_and_methods():
    def outer(inner):
        return lambda x: inner(x) + 1

    assert function_key(outer(_scaled(2.0))) == function_key(outer(_scaled(2.0)))
    assert function_key(outer(_scaled(2.0))) != function_key(outer(_scaled(5.0)))

    def f(x, k):
        return x * k

    assert function_key(functools.partial(f, k=2)) == function_key(functools.partial(f, k=2))
    assert function_key(functools.partial(f, k=2)) != function_key(functools.partial(f, k=3))

    class Loss:
        def __call__(self, x):
            return x

        def method(self, x):
            return x

    one, two = Loss(), Loss()
    assert function_key(one.method) == function_key(one.method)
    assert function_key(one.method) != function_key(two.method)
    assert function_key(one) == function_key(one) != function_key(two)


def test_code_keyed_calls_through_and_hashes_by_code():
    f, g = code_keyed(_scaled(2.0)), code_keyed(_scaled(2.0))
    assert f == g and hash(f) == hash(g) and f(3.0) == 6.0
    assert code_keyed(None) is None and code_keyed(f) is f


def test_step_cache_builds_once_per_key_and_warns_once_on_changing_closures():
    cache, built = StepCache("Thing.train_step"), []
    for _ in range(3):
        cache.get(_scaled(2.0), "mode", lambda: built.append(1) or len(built))
    assert len(built) == 1 and len(cache) == 1
    with pytest.warns(UserWarning, match=r"Thing.train_step compiled a new step 4 times.*"
                                         r"define loss_fn once"):
        for i in range(RECOMPILE_WARNING_AFTER - 1):
            cache.get(_scaled(np.ones(1) * i), "mode", lambda: built.append(1))
    # no second warning (warnings are errors in this suite)
    for i in range(3):
        cache.get(_scaled(np.ones(1) * i), "mode", lambda: built.append(1))
    assert len(built) == 1 + RECOMPILE_WARNING_AFTER - 1 + 3


def test_ddp_fresh_lambdas_reuse_one_step_and_train_as_one_function(world):
    ddp = DistributedDataParallel(MLP(0), optax.sgd(0.1), group=group(4))
    ref = Reference(MLP(0), optax.sgd(0.1))
    weight = 1.0
    for batch in make_batches(3, 16):
        # a new closure object each step, as torch users write them
        ddp.train_step(lambda m, b: loss_fn(m, b) * weight, batch)
        ref.step(batch)
    assert len(ddp._compiled) == 1
    assert_trees_close(ddp.params, ref.params)


@pytest.mark.cpu_only  # a pipeline over 2 devices
def test_pipeline_fresh_lambdas_reuse_the_compiled_program():
    import jax
    from jax.sharding import Mesh

    from jaxpg.pipeline.api import StagedParams, pipeline_value_and_grad
    from jaxpg.pipeline.lockstep.executor import _compiled

    k = jax.random.split(jax.random.key(0), 3)
    params = StagedParams({"w": jax.random.normal(k[0], (2, 4, 4)) * 0.5}, None,
                          jax.random.normal(k[1], (4, 2)))
    x, t = jax.random.normal(k[2], (8, 4)), jnp.ones((8, 2))
    mesh = Mesh(np.array(jax.devices()[:2]), ("pp",))
    before = _compiled.cache_info().misses
    losses = []
    for _ in range(3):
        loss, _ = pipeline_value_and_grad(
            lambda w, h: jnp.tanh(h @ w["w"]), lambda last, h, tt: jnp.mean((h @ last - tt) ** 2),
            params, x, t, mesh=mesh, schedule="1f1b", num_microbatches=2, executor="spmd")
        losses.append(float(loss))
    assert _compiled.cache_info().misses - before == 1
    assert losses[0] == losses[1] == losses[2]
