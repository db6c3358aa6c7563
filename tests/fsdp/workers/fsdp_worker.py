"""FSDP across processes (one rank each, under jaxpg-run), checked against DDP and local
references. Prints ``CHECK <name> ok``; a mismatch raises and the launcher exits non-zero.

argv: a scratch directory holding ``ckpt4`` (saved by the test with 4 ranks in one
process); this worker writes ``ckpt2`` there (saved by these 2 processes).
"""

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: _arrays
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "pipeline"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _arrays import allclose  # noqa: E402
from _damage import cut_array_files  # noqa: E402
from _fsdp_models import HIDDEN, Block, Net, Reference, loss_fn, make_batches  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpg  # noqa: E402
from jaxpg.ddp import DistributedDataParallel  # noqa: E402
from jaxpg.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy  # noqa: E402
from jaxpg.fsdp.checkpoint import restore_checkpoint, save_checkpoint  # noqa: E402

PER_RANK = 4
OPT = optax.sgd(0.5, momentum=0.9)  # linear in the gradient: a wrong average shows
BF16 = MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)


def check(name, cond=True):
    if not cond:
        raise AssertionError(f"{name} failed on process {jax.process_index()}")
    print(f"CHECK {name} ok", flush=True)


def close(a, b, tol=1e-5):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=tol, atol=tol)
        for x, y in zip(la, lb, strict=True))


def local(batch, rank):
    return jax.tree.map(lambda x: x[rank * PER_RANK:(rank + 1) * PER_RANK], batch)


def main(scratch):
    scratch = Path(scratch)
    jaxpg.init_process_group()
    rank, n = jaxpg.get_rank(), jaxpg.get_world_size()
    batches = make_batches(3, PER_RANK * n)

    # 1. stages 1-3, with and without resharding and mixed precision, vs DDP (rank 0's
    # init) or the mixed-precision reference
    ddp = DistributedDataParallel(Net(seed=rank), OPT)
    for b in batches:
        ddp.train_step(loss_fn, local(b, rank))
    mp_ref = Reference(Net(0), OPT, policy=BF16, n=n)
    for b in batches:
        mp_ref.step(b)
    for stage, reshard, policy in ((1, True, None), (2, True, None), (3, True, None),
                                   (3, False, BF16)):
        fsdp = FullyShardedDataParallel(Net(seed=rank), OPT, zero_stage=stage, units=Block,
                                        reshard_after_forward=reshard, mp_policy=policy)
        for b in batches:
            fsdp.train_step(loss_fn, local(b, rank))
        want = ddp.params if policy is None else mp_ref.params
        name = f"stage{stage}_{'reshard' if reshard else 'keep'}_{'bf16' if policy else 'fp32'}"
        check(name, close(fsdp.full_params(), want))

    # 2. a checkpoint saved by 4 ranks (one process) resumed by these 2 processes
    more = make_batches(2, PER_RANK * n, seed=7)
    ref = Reference(Net(0), OPT)
    for b in make_batches(3, 16) + more:
        ref.step(b)
    resumed = FullyShardedDataParallel(Net(seed=5), OPT, units=Block)
    step, data_state = restore_checkpoint(scratch / "ckpt4", resumed)
    for b in more:
        resumed.train_step(loss_fn, local(b, rank))
    check("resume_from_4_ranks", step == 3 and data_state == {"batch": 3}
          and close(resumed.full_params(), ref.params))
    # each process holds only its shard of the (7, 12) kernel padded to 8 rows
    kernel = resumed.params["embed"]["kernel"]
    check("holds_its_shard", [s.data.shape for s in kernel.addressable_shards] == [(4, HIDDEN)])

    # 3. these 2 processes save their shards; the test resumes them with 4 ranks
    save_checkpoint(scratch / "ckpt2", resumed, data_state={"batch": 5})
    check("saved_sharded")

    # 3b. a newer step, its array files cut in half (a node lost mid-write): the restore
    # falls back to step 5 with one warning naming step 6 (and so does the test's)
    at5 = resumed.full_params()
    resumed.train_step(loss_fn, local(make_batches(1, PER_RANK * n, seed=9)[0], rank))
    save_checkpoint(scratch / "ckpt2", resumed, data_state={"batch": 6})
    jaxpg.barrier()
    if rank == 0:
        cut_array_files(scratch / "ckpt2" / "6")
    jaxpg.barrier()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step, data_state = restore_checkpoint(scratch / "ckpt2", resumed)
    texts = [str(w.message) for w in seen]
    check("damaged_newest_skipped", (step, data_state) == (5, {"batch": 5}) and len(texts) == 1
          and "step=6: array file" in texts[0] and close(resumed.full_params(), at5, tol=0))

    # 4. ZeRO-2 and 3 over dp inside a pipeline stage (dp=2 across the processes, pp=1)
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from test_executor import block, embed, head_loss, make_batch, make_params

    from jaxpg.pipeline.train_step import init_train_state, make_train_step
    from jaxpg.pipeline.zero import init_zero_train_state, make_zero_train_step

    mesh = Mesh(np.array(jax.devices()).reshape(2, 1), ("dp", "pp"))
    whole = jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, P()))
    x, t = (np.asarray(a) for a in make_batch(8))
    results = []
    for zero in (0, 2, 3):
        kwargs = {"schedule": "gpipe", "num_microbatches": 2, "first_fn": embed}
        if zero == 2:
            params, opt_state = init_zero_train_state(make_params(1), OPT, mesh)
            step = make_zero_train_step(block, head_loss, OPT, params, mesh=mesh,
                                        zero_stage=2, **kwargs)
        else:  # zero_stage=3: every parameter split over dp, gathered by each stage
            params, opt_state = init_train_state(make_params(1), OPT, mesh, zero_stage=zero)
            step = make_train_step(block, head_loss, OPT, mesh=mesh, zero_stage=zero,
                                   params=params, **kwargs)
        for _ in range(2):
            params, opt_state, _ = step(params, opt_state, x, t)
        split = NamedSharding(mesh, P("pp", "dp"))
        if zero == 3 and not params.stages["w"].sharding.is_equivalent_to(split, 3):
            raise AssertionError(f"zero_stage=3 left {params.stages['w'].sharding}")
        results.append([np.asarray(a.addressable_shards[0].data)
                        for a in jax.tree.leaves(whole(params))])
    check("pipeline_zero2_over_dp", close(results[0], results[1]))
    check("pipeline_zero3_over_dp", close(results[0], results[2]))

    # 5. a group that holds no rank of this process
    only0 = jaxpg.new_group([0])
    if rank == 1:
        try:
            FullyShardedDataParallel(Net(0), OPT, group=only0)
            message = ""
        except ValueError as e:
            message = str(e)
        check("group_without_this_process", "not a member of the group" in message)
    else:
        check("group_without_this_process")

    # 6. a rank with another layer size: the named error on every rank
    class Wider(Net):
        def __init__(self):
            super().__init__(0)
            self.head = nnx.Linear(HIDDEN, 6, rngs=nnx.Rngs(0))

    try:
        FullyShardedDataParallel(Net(0) if rank == 0 else Wider(), OPT)
        message = ""
    except ValueError as e:
        message = str(e)
    check("shape_mismatch_named", "['head']['bias']" in message and "[1]" in message)
    jaxpg.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
