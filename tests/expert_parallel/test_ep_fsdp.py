"""``FullyShardedDataParallel(..., expert_axes=("ep",))`` over a ``("dp", "ep")`` mesh, every
stage: parameters sharded over dp (the experts on top of their ep split), the experts'
gradients averaged over dp only, the rest over both; against one-device SGD (with and
without momentum) on the whole batch; and the errors of the option."""

import optax
import pytest
from _ep_ddp_net import Net, loss_fn
from flax import nnx
from test_ep_ddp import assert_leaves_close, batches, one_device_params

import jaxpg
from jaxpg.fsdp import FullyShardedDataParallel


@pytest.mark.parametrize("stage,opt", [(1, "momentum"), (2, "sgd"), (3, "momentum")])
def test_experts_are_averaged_over_dp_only_as_one_device_training(stage, opt):
    # optimizers whose steps scale with the gradient (Adam's hardly does: a wrongly scaled
    # reduction would pass), one of them with state to shard
    make_opt = {"sgd": lambda: optax.sgd(0.5),
                "momentum": lambda: optax.sgd(0.3, momentum=0.9)}[opt]
    mesh = jaxpg.init_device_mesh((2, 4), ("dp", "ep"))  # 8 ranks: 2 experts on each
    fsdp = FullyShardedDataParallel(Net(mesh.get_group("ep"), nnx.Rngs(0)), make_opt(),
                                    expert_axes=("ep",), zero_stage=stage)
    assert fsdp.group.describe() == "shard over dp (2), experts split over ep (4)"
    assert fsdp.world_size == 8
    if stage == 3:  # each rank holds half of its 2 experts' rows: (E=8, d=8, f=16) / 4 / 2
        w1 = fsdp.params["moe"]["w1"]
        assert w1.addressable_shards[0].data.shape == (1, 8, 16)
        dense = fsdp.params["inp"]["kernel"]
        assert dense.addressable_shards[0].data.shape == (4, 8)  # over dp, replicated over ep
    for batch in batches():
        fsdp.train_step(loss_fn, batch)
    assert_leaves_close(fsdp.full_params(), one_device_params(make_opt()))


def test_expert_axes_errors():
    mesh = jaxpg.init_device_mesh((2, 4), ("dp", "ep"))
    net = Net(mesh.get_group("ep"), nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"\['moe'\]\['w1'\].* is split over the data-parallel "
                                         r"axes \['ep'\]"):
        FullyShardedDataParallel(net, optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"expert_axes='ep' must be a tuple of axis names"):
        FullyShardedDataParallel(net, optax.sgd(0.1), expert_axes="ep")
    with pytest.raises(ValueError, match=r"expert_axes=\('ep',\) with a model that no mesh "
                                         r"splits"):
        FullyShardedDataParallel(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), optax.sgd(0.1),
                                 expert_axes=("ep",))
