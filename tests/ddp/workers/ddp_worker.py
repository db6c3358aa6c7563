"""DDP across processes (one rank each, under jaxpg-run), checked against local references.

Every process can compute the single-device reference by itself (the global batch is a
function of the step), so each check compares this process's replicated DDP state with it.
Prints ``CHECK <name> ok``; a mismatch raises, and the launcher exits non-zero.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: _arrays

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _arrays import allclose  # noqa: E402
from _ddp_models import MLP, Reference, group, loss_fn, make_batches  # noqa: E402, F401

import jaxpg  # noqa: E402
from jaxpg.ddp import DistributedDataParallel, restore_checkpoint, save_checkpoint  # noqa: E402

PER_RANK = 4


def check(name, cond=True):
    if not cond:
        raise AssertionError(f"{name} failed on process {jax.process_index()}")
    print(f"CHECK {name} ok", flush=True)


def close(a, b, tol=1e-5):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)
        for x, y in zip(la, lb, strict=True))


def local(batch, rank):
    return jax.tree.map(lambda x: x[rank * PER_RANK:(rank + 1) * PER_RANK], batch)


def main(tmp_dir):
    jaxpg.init_process_group()
    rank, n = jaxpg.get_rank(), jaxpg.get_world_size()
    opt = optax.sgd(0.1, momentum=0.9)
    batches = make_batches(3, PER_RANK * n)

    # 1. equals single-device training on the concatenated batch; rank 0's init wins
    ddp = DistributedDataParallel(MLP(seed=rank), opt, bucket_cap_mb=0.0005,
                                  first_bucket_mb=0.0002, comm_hook="powerSGD",
                                  comm_hook_config={"start_powerSGD_iter": 100})
    ref = Reference(MLP(seed=0), opt)
    for b in batches:
        loss = ddp.train_step(loss_fn, local(b, rank))["loss"]
        want = ref.step(b)
    check("equals_reference", close(ddp.params, ref.params))
    check("loss_is_global_mean", abs(float(loss) - float(want)) < 1e-5)

    # 2. checkpoint: saved once, restored on every rank, same trajectory afterwards
    save_checkpoint(tmp_dir, ddp, data_state={"batch": 3})
    more = make_batches(2, PER_RANK * n, seed=9)
    for b in more:
        ddp.train_step(loss_fn, local(b, rank))
    resumed = DistributedDataParallel(MLP(seed=5), opt, bucket_cap_mb=0.0005,
                                      first_bucket_mb=0.0002, comm_hook="powerSGD",
                                      comm_hook_config={"start_powerSGD_iter": 100})
    step, data_state = restore_checkpoint(tmp_dir, resumed)
    for b in more:
        resumed.train_step(loss_fn, local(b, rank))
    check("checkpoint_resume", step == 3 and data_state == {"batch": 3}
          and close(resumed.params, ddp.params, 1e-6))

    # 3. join: rank 1 has one batch, rank 0 three; rank 1 shadows with zeros
    lengths = [3] + [1] * (n - 1)
    ddp = DistributedDataParallel(MLP(0), opt)
    ref = Reference(MLP(0), opt)
    with ddp.join() as join:
        for b in batches[:lengths[rank]]:
            ddp.train_step(loss_fn, local(b, rank))
    for step, b in enumerate(batches):
        grads = [ref.grads(ref.params, ref.rest, local(b, r))[1]
                 for r in range(n) if step < lengths[r]]
        ref.apply(jax.tree.map(lambda *g: sum(g) / n, *grads))
    check("join_uneven_inputs", join.num_active == 0 and ddp.step == 4
          and close(ddp.params, ref.params))

    # 4. throw_on_early_termination raises on every rank
    ddp = DistributedDataParallel(MLP(0), opt)
    try:
        with ddp.join(throw_on_early_termination=True):
            for b in batches[:lengths[rank]]:
                ddp.train_step(loss_fn, local(b, rank))
        raised = False
    except RuntimeError as e:
        raised = "exhausted inputs" in str(e)
    check("throw_on_early_termination", raised)

    # 5. a rank with another layer size: the named error on every rank
    class Wider(MLP):
        def __init__(self):
            super().__init__(0)
            from flax import nnx
            self.l2 = nnx.Linear(16, 5, rngs=nnx.Rngs(0))

    try:
        DistributedDataParallel(MLP(0) if rank == 0 else Wider(), opt)
        message = ""
    except ValueError as e:
        message = str(e)
    check("shape_mismatch_named", "['l2']['bias']" in message and "[1]" in message)
    jaxpg.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
