"""``DistributedDataParallel(..., expert_axes=("ep",))`` over a ``("dp", "ep")`` mesh: the
experts averaged over dp only, the rest over both, against one-device SGD on the whole batch;
and the errors of the option."""

import jax
import numpy as np
import optax
import pytest
from _ep_ddp_net import D, Net, loss_fn
from flax import nnx

import jaxpg
from jaxpg.ddp import DistributedDataParallel

ROWS, STEPS = 16, 3


def batches():
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        yield (rng.normal(size=(ROWS, D)).astype(np.float32),
               rng.normal(size=(ROWS, D)).astype(np.float32))


def one_device_params(opt=None):
    """The parameters after one-device training on the whole batches (SGD 0.5 by default)."""
    group, _ = jaxpg.new_subgroups(group_size=1)
    model = Net(group, nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    opt = opt or optax.sgd(0.5)
    opt_state = opt.init(state)
    for batch in batches():
        grads = jax.grad(lambda s, b=batch: loss_fn(nnx.merge(graphdef, s), b))(state)
        updates, opt_state = opt.update(grads, opt_state, state)
        state = optax.apply_updates(state, updates)
    return jax.tree.leaves(state)


@pytest.mark.parametrize("reduction", ["buckets", "fused_pmean"])
def test_experts_are_averaged_over_dp_only_as_one_device_training(reduction):
    mesh = jaxpg.init_device_mesh((2, 4), ("dp", "ep"))  # 8 ranks: 2 experts on each
    ddp = DistributedDataParallel(Net(mesh.get_group("ep"), nnx.Rngs(0)), optax.sgd(0.5),
                                  expert_axes=("ep",), reduction=reduction)
    w1 = ddp.params["moe"]["w1"]
    assert w1.sharding.spec[0] == "ep" and w1.addressable_shards[0].data.shape[0] == 2
    for batch in batches():
        ddp.train_step(loss_fn, batch)
    assert_leaves_close(ddp.params, one_device_params())


def assert_leaves_close(tree, want):
    got = jax.tree.leaves(tree)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6)


def test_expert_axes_errors():
    mesh = jaxpg.init_device_mesh((2, 4), ("dp", "ep"))
    net = Net(mesh.get_group("ep"), nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"\['moe'\]\['w1'\].* is split over the data-parallel "
                                         r"axes \['ep'\].*name it in expert_axes"):
        DistributedDataParallel(net, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"expert_axes=\('tp',\) names \['tp'\], which are not "
                                         r"data-parallel axes of the group \(\['dp', 'ep'\]\)"):
        DistributedDataParallel(net, optax.sgd(0.1), expert_axes=("tp",))
    with pytest.raises(TypeError, match=r"expert_axes='ep' must be a tuple of axis names"):
        DistributedDataParallel(net, optax.sgd(0.1), expert_axes="ep")
    with pytest.raises(ValueError, match=r"zero_stage=1 \(ZeRO-1\) does not take "
                                         r"expert parameters"):
        DistributedDataParallel(net, optax.sgd(0.1), expert_axes=("ep",),
                                zero_stage=1)
