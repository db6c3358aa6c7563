"""A loss that cannot train is named on the first trace of DDP's and FSDP's steps: a loss that
closes over the unwrapped module, or calls the wrapper, instead of using its model argument.
Frozen parameters are fine. One process, simulated ranks."""

import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from _ddp_models import MLP, Reference, group, loss_fn, make_batches

from jaxpg.data_parallel.loss_check import LossDoesNotTrainError, jaxpr_depends
from jaxpg.ddp import DistributedDataParallel
from jaxpg.fsdp import FullyShardedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fsdp"))
from _fsdp_models import Block, Net  # noqa: E402
from _fsdp_models import loss_fn as net_loss  # noqa: E402

NAMED = r"loss_fn .*does not depend on the trainable parameters of its model argument `m`.*" \
        r"closes over the module as it was before wrapping.*calls the wrapper"


def _ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _wrappers():
    return {
        "ddp": lambda model: DistributedDataParallel(model, optax.sgd(0.1), group=group(4)),
        "fsdp3": lambda model: FullyShardedDataParallel(model, optax.sgd(0.1), group=group(4),
                                                        units=Block),
        "fsdp2": lambda model: FullyShardedDataParallel(model, optax.sgd(0.1), group=group(4),
                                                        zero_stage=2),
    }


@pytest.mark.parametrize("kind", ["ddp", "fsdp3", "fsdp2"])
def test_a_loss_over_the_unwrapped_module_is_named(world, kind):
    model = Net(0)
    wrapped = _wrappers()[kind](model)
    batch = {"x": np.ones((8, 7), np.float32), "y": np.zeros(8, np.int32)}
    before = jax.tree.map(np.asarray, wrapped.params)
    with pytest.raises(LossDoesNotTrainError, match=NAMED):
        wrapped.train_step(lambda m, b: _ce(model(b["x"]), b["y"]), batch)
    # nothing ran: the parameters are those of before the call
    jax.tree.map(np.testing.assert_array_equal, before,
                 jax.tree.map(np.asarray, wrapped.params))
    assert wrapped.step == 0


def test_a_loss_that_calls_the_ddp_wrapper_is_named(world):
    ddp = DistributedDataParallel(MLP(0), optax.sgd(0.1), group=group(4))
    batch = make_batches(1, 8)[0]
    with pytest.raises(LossDoesNotTrainError, match=NAMED):
        ddp.train_step(lambda m, b: _ce(ddp(b["x"]), b["y"]), batch)
    with pytest.raises(LossDoesNotTrainError, match=r"its parameter argument `p`"):
        DistributedDataParallel({"w": np.ones((6, 4), np.float32)}, optax.sgd(0.1),
                                group=group(2)).train_step(lambda p, b: b["x"].sum(), batch)


def test_a_loss_over_frozen_and_trainable_parameters_trains(world):
    """``stop_gradient`` on the first layer: only the head trains, as one device does."""

    def frozen_l1(m, b):
        h = jax.lax.stop_gradient(jax.nn.relu(m.l1(b["x"])))
        return _ce(m.l2(h), b["y"])

    ddp = DistributedDataParallel(MLP(0), optax.sgd(0.5), group=group(4))
    ref = Reference(MLP(0), optax.sgd(0.5), loss=frozen_l1)
    for batch in make_batches(2, 16):
        ddp.train_step(frozen_l1, batch)
        ref.step(batch)
    np.testing.assert_array_equal(np.asarray(ddp.params["l1"]["kernel"][...]),
                                  np.asarray(MLP(0).l1.kernel[...]))
    np.testing.assert_allclose(np.asarray(ddp.params["l2"]["kernel"][...]),
                               np.asarray(ref.params["l2"]["kernel"][...]), rtol=1e-5,
                               atol=1e-6)
    assert not np.allclose(np.asarray(ddp.params["l2"]["kernel"][...]),
                           np.asarray(MLP(0).l2.kernel[...]))


def test_fsdp_frozen_and_no_sync_steps_pass_the_check(world):
    fsdp = FullyShardedDataParallel(Net(0), optax.sgd(0.1), group=group(4), units=Block)

    def frozen_embed(m, b):
        return net_loss(m, {"x": jax.lax.stop_gradient(b["x"]), "y": b["y"]})

    batch = {"x": np.ones((8, 7), np.float32), "y": np.zeros(8, np.int32)}
    with fsdp.no_sync():
        fsdp.train_step(frozen_embed, batch)
    out = fsdp.train_step(frozen_embed, batch)
    assert np.isfinite(float(out["loss"]))


def test_the_check_runs_once_per_compiled_step(world, monkeypatch):
    from jaxpg.data_parallel import loss_check

    checks, calls = [], []
    reaches = loss_check._cotangent_reaches
    monkeypatch.setattr(loss_check, "_cotangent_reaches",
                        lambda *a: checks.append(1) or reaches(*a))
    ddp = DistributedDataParallel(MLP(0), optax.sgd(0.1), group=group(2))

    def counted(m, b):
        calls.append(1)
        return loss_fn(m, b)

    for batch in make_batches(2, 8) + make_batches(1, 16):
        ddp.train_step(counted, batch)
    # one trace per batch shape (the check adds none); the check ran on the first only
    assert (len(calls), len(checks)) == (2, 1)


def test_jaxpr_depends_walks_through_equations():
    closed = jax.make_jaxpr(lambda a, b, c: (a * 2.0).sum() + jax.numpy.sin(c))(1.0, 2.0, 3.0)
    assert [jaxpr_depends(closed.jaxpr, [i == k for i in range(3)]) for k in range(3)] == \
        [True, False, True]
