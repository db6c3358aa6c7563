"""torch's calling habits on DDP: ``ddp(x)`` forwards, ``DistributedSampler(dataset)`` takes
its replicas and rank from the default group. One process, 8 simulated ranks; the
multi-process case (one rank per process) runs in docs/porting.md's tested DDP example."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _ddp_models import IN, MLP, Reference, group, loss_fn, make_batches

import jaxpg
from jaxpg.ddp import DistributedDataParallel, DistributedSampler


def test_calling_ddp_runs_the_forward_with_the_current_parameters(world):
    ddp = DistributedDataParallel(MLP(0), optax.sgd(0.1), group=group(4))
    ref = Reference(MLP(0), optax.sgd(0.1))
    x = np.random.default_rng(0).standard_normal((5, IN)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(ddp(x)), np.asarray(MLP(0)(jnp.asarray(x))),
                               rtol=1e-6)
    for batch in make_batches(2, 16):
        ddp.train_step(loss_fn, batch)
        ref.step(batch)
    from flax import nnx

    trained = nnx.merge(ref.graphdef, ref.params, ref.rest)
    out = ddp(x)  # after the steps: the updated parameters, as torch's ddp(x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(trained(jnp.asarray(x))),
                               rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(out), np.asarray(MLP(0)(jnp.asarray(x))))
    assert len(out.sharding.device_set) == 1  # this process's own replica, no communication


def test_calling_a_linen_ddp_says_how_to_apply_it(world):
    params = {"w": jnp.ones((IN, 2))}
    ddp = DistributedDataParallel(params, optax.sgd(0.1), group=group(2))
    with pytest.raises(TypeError, match=r"model.apply\(\{'params': ddp.params\}, x\)"):
        ddp(jnp.ones((1, IN)))


def test_sampler_takes_replicas_and_rank_from_the_default_group(world):
    # one process holds all 8 ranks: it is one replica, and DDP splits its share
    state = jaxpg.groups.world.current()
    sampler = DistributedSampler(list(range(10)), shuffle=False)
    assert (sampler.num_replicas, sampler.rank) == (state.process_count, state.process_index)
    assert (sampler.num_replicas, sampler.rank) == (1, 0)
    assert list(sampler) == list(range(10))
    explicit = DistributedSampler(10, num_replicas=4, rank=3, shuffle=False)
    assert list(explicit) == [3, 7, 1]  # torch's padding: [0..9, 0, 1], every 4th from 3
    assert DistributedSampler(10, num_replicas=2, shuffle=False).rank == 0


def test_sampler_without_a_world_says_what_to_do():
    if jaxpg.is_initialized():
        jaxpg.destroy_process_group()
    with pytest.raises(ValueError, match=r"call jaxpg.init_process_group\(\) first"):
        DistributedSampler(10)
    assert jax.devices()  # the sampler needed no JAX
