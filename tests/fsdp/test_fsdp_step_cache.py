"""FSDP's compiled step is cached by the loss function's code and closure: a fresh lambda
each step reuses one step and trains as the same function reused."""

import optax
from _fsdp_models import Net, assert_trees_close, group, loss_fn, make_batches

from jaxpg.fsdp import FullyShardedDataParallel


def test_fsdp_fresh_lambdas_reuse_one_step(world):
    fresh = FullyShardedDataParallel(Net(0), optax.adam(1e-2), group=group(4))
    reused = FullyShardedDataParallel(Net(0), optax.adam(1e-2), group=group(4))
    scale = 1.0
    for batch in make_batches(3, 16):
        fresh.train_step(lambda m, b: loss_fn(m, b) * scale, batch)
        reused.train_step(loss_fn, batch)
    assert len(fresh._compiled) == 1
    assert_trees_close(fresh.full_state_dict()["params"], reused.full_state_dict()["params"],
                       rtol=1e-6, atol=1e-7)


def test_a_batch_that_does_not_divide_and_a_non_scalar_loss_are_named(world):
    """The batch placement and the loss check DDP shares, with FSDP's own wording."""
    import numpy as np
    import pytest

    fsdp = FullyShardedDataParallel(Net(0), optax.sgd(0.1), group=group(4))
    (batch,) = make_batches(1, 8)
    odd = {k: np.asarray(v)[:6] for k, v in batch.items()}
    with pytest.raises(ValueError, match=r"shape \(6, .*among this process's 4 rank\(s\) of the "
                                         r"FSDP group\. Drop or pad the last batch"):
        fsdp.train_step(loss_fn, odd)
    with pytest.raises(ValueError, match=r"scalar loss .* returned shape \(8,"):
        fsdp.train_step(lambda m, b: loss_fn(m, b) * np.ones(8, np.float32), batch)
