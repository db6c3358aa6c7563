"""What a job started by ``srun``, ``mpirun`` or ``jaxpg-run`` runs in the cluster tests.

    cluster_worker.py BACKEND [PARTS]

``init_process_group(backend=BACKEND)`` with no other argument (``default``: None), so the
world comes from the launcher's variables alone. Then, by ``PARTS`` (comma-separated,
default ``collectives,ddp,pipeline``; ``world`` is one all_reduce): every collective
against numpy over all ranks' inputs, a DDP step (``ddp``) and an FSDP stage-3 step
(``fsdp``, not in the default) against one-process training on the whole batch, a pipeline
step against the un-pipelined model. Prints ``WORLD <rank> <size>
<backend>``, ``CHECK <name> ok`` per check (with MPI also ``mpi_wrong_thread``: a collective
from another thread raises ``DistError``), ``UNSUPPORTED <name>`` where the backend raised
the NotImplementedError it must raise, ``TIME <part>`` and ``DONE``; any mismatch raises
(the process exits non-zero).
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: _arrays

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _arrays import allclose
from collectives_worker import check, close, data
from flax import nnx

import jaxpg


def expect_unsupported(name, fn):
    """Runs ``fn``; it must raise the NotImplementedError that names ``name``."""
    try:
        fn()
    except NotImplementedError as err:
        assert "backend='mpi'" in str(err), err
        print(f"UNSUPPORTED {name}: {str(err)[:80]}", flush=True)
        return
    raise AssertionError(f"{name} should raise NotImplementedError with backend='mpi'")


def wrong_thread_error(me: int) -> "jaxpg.DistError | None":
    """backend='mpi': an all_reduce called from another thread than init_process_group's
    raises ``DistError`` naming that thread before anything runs; returns it (else None)."""
    import threading

    caught = []

    def call():
        try:
            jaxpg.all_reduce(data(me))
        except jaxpg.DistError as err:
            caught.append(err)

    thread = threading.Thread(target=call, name="not-mpis-thread", daemon=True)
    thread.start()
    thread.join(60)
    if len(caught) != 1 or type(caught[0]) is not jaxpg.DistError:
        return None
    text = str(caught[0])
    ok = "must be called from the thread that called init_process_group" in text and \
        "'not-mpis-thread'" in text and text.startswith("all_reduce: with backend='mpi'")
    return caught[0] if ok else None


def world_sum(me: int, n: int, mpi: bool) -> None:
    """One all_reduce: enough to show the launcher's world works."""
    check("world_all_reduce", close(jaxpg.all_reduce(data(me)), sum(data(r) for r in range(n))))


def collectives(me: int, n: int, mpi: bool) -> None:
    ranks = range(n)
    full = lambda fn: [fn(r) for r in ranks]  # noqa: E731
    for dtype in (np.float32, jnp.bfloat16, np.float16):
        got = np.asarray(jaxpg.all_reduce(jnp.asarray(data(me), dtype)), np.float32)
        want = sum(np.asarray(jnp.asarray(data(r), dtype), np.float32) for r in ranks)
        check(f"all_reduce_sum_{jnp.dtype(dtype).name}", close(got, want))
    ops = {"max": (jaxpg.ReduceOp.MAX, np.maximum.reduce),
           "min": (jaxpg.ReduceOp.MIN, np.minimum.reduce),
           "product": (jaxpg.ReduceOp.PRODUCT, np.multiply.reduce),
           "avg": (jaxpg.ReduceOp.AVG, lambda a: np.mean(a, 0))}
    for name, (op, ref) in ops.items():
        got = jaxpg.all_reduce(data(me) / 10, op=op)
        check(f"all_reduce_{name}", close(got, ref(np.stack(full(data)) / 10)))
    x = data(me, dtype=np.int32) % 7
    got = jaxpg.all_reduce(x, op=jaxpg.ReduceOp.BXOR)
    check("all_reduce_bxor", (np.asarray(got) == np.bitwise_xor.reduce(
        [data(r, dtype=np.int32) % 7 for r in ranks])).all())
    got = jaxpg.all_reduce(np.array([me == 1, False]))
    check("all_reduce_bool", np.asarray(got).tolist() == [n > 1, False])

    parts = jaxpg.all_gather(data(me))
    check("all_gather", all(close(parts[r], data(r)) for r in ranks))
    parts = jaxpg.all_gather(jnp.full((me + 1, 2), me, jnp.float16))
    check("all_gather_uneven_float16", all(
        np.asarray(parts[r]).shape == (r + 1, 2) and (np.asarray(parts[r]) == r).all()
        for r in ranks))
    got = jaxpg.all_gather_into_tensor(data(me))
    check("all_gather_into_tensor", close(got, np.concatenate(full(data))))
    got = jaxpg.reduce_scatter_tensor(data(me, (2 * n,)))
    total = sum(data(r, (2 * n,)) for r in ranks)
    check("reduce_scatter_tensor", close(got, total[2 * me: 2 * me + 2]))
    got = jaxpg.broadcast(jnp.asarray(data(me), jnp.float16), src=n - 1)
    check("broadcast", close(got, data(n - 1)))
    got = jaxpg.reduce(data(me), dst=0)
    check("reduce", close(got, sum(full(data)) if me == 0 else data(me)))
    gathered = jaxpg.gather(data(me), dst=0)
    check("gather", all(close(gathered[r], data(r)) for r in ranks) if me == 0
          else gathered is None)
    got = jaxpg.scatter(np.zeros(2, np.float32),
                        scatter_list=[np.full(2, 100 + r, np.float32) for r in ranks]
                        if me == 1 else None, src=1)
    check("scatter", close(got, np.full(2, 100 + me)))
    out = jaxpg.all_to_all([np.full((me + i + 1, 1), 10 * me + i, np.float32) for i in ranks])
    check("all_to_all_uneven", all(np.asarray(out[j]).shape == (j + me + 1, 1)
                                   and (np.asarray(out[j]) == 10 * j + me).all() for j in ranks))
    got = np.asarray(jaxpg.all_to_all_single(np.arange(2 * n, dtype=np.float32) + 100 * me))
    want = np.concatenate([np.arange(2 * me, 2 * me + 2, dtype=np.float32) + 100 * j
                           for j in ranks])
    check("all_to_all_single", (got == want).all())
    work = jaxpg.all_reduce(jnp.asarray(data(me)), async_op=True)
    check("async_op", close(work.result(), sum(full(data))))
    objs = jaxpg.all_gather_object({"rank": me})
    check("all_gather_object", [o["rank"] for o in objs] == list(ranks))
    got = jaxpg.broadcast_object_list(["a", 1] if me == 0 else [None, None], src=0)
    check("broadcast_object_list", got == ["a", 1])
    got = jaxpg.scatter_object_list([f"x{r}" for r in ranks] if me == 0 else None, src=0)
    check("scatter_object_list", got == f"x{me}")
    jaxpg.barrier()
    jaxpg.monitored_barrier(wait_all_ranks=True)
    check("barriers", True)
    if mpi:  # XLA's MPI collectives serve only the thread that started MPI
        check("mpi_wrong_thread", wrong_thread_error(me) is not None)

    if n % 2 == 0:  # a family of subgroups that covers every process
        sub, _ = jaxpg.new_subgroups(2)
        got = jaxpg.all_reduce(data(me), group=sub)
        pair = [me - me % 2, me - me % 2 + 1]
        check("new_subgroups_all_reduce", close(got, sum(data(r) for r in pair)))
    spmd_sum = jax.jit(jaxpg.spmd(lambda v: jaxpg.all_reduce(v) + jaxpg.get_rank()))
    world = jaxpg.GroupMember.WORLD
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    x = jax.make_array_from_process_local_data(NamedSharding(world.mesh, P(world.axis_name)),
                                               data(me)[None], (n, 3))
    got = spmd_sum(x).addressable_shards[0].data[0]
    check("spmd_all_reduce", close(got, sum(full(data)) + me))

    partial = n > 2  # a group (or a pair) that leaves processes out
    pair_group = jaxpg.new_group([0, n - 1])

    def subgroup_sum():
        got = jaxpg.all_reduce(data(me), group=pair_group)
        check("new_group_all_reduce", close(got, data(0) + data(n - 1)))

    def ring():
        works = jaxpg.batch_isend_irecv([
            jaxpg.P2POp(jaxpg.isend, jnp.full(2, float(me)), (me + 1) % n),
            jaxpg.P2POp(jaxpg.irecv, None, (me - 1) % n)])
        for w in works:
            w.wait()
        check("batch_isend_irecv_ring", close(works[1].result(), np.full(2, (me - 1) % n)))

    def send_recv():
        if me == 0:
            jaxpg.send(jnp.arange(6.0).reshape(2, 3), dst=n - 1)
        elif me == n - 1:
            got = jaxpg.recv(src=0)
            check("send_recv", got.shape == (2, 3) and float(got.sum()) == 15.0)

    if pair_group is not jaxpg.GroupMember.NON_GROUP_MEMBER:
        (expect_unsupported if mpi and partial else lambda _, f: f())("new_group", subgroup_sum)
    (expect_unsupported if mpi and partial else lambda _, f: f())("batch_isend_irecv", ring)
    if me in (0, n - 1):
        (expect_unsupported if mpi and partial else lambda _, f: f())("send_recv", send_recv)
    jaxpg.barrier()


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.tanh(self.l1(x)))


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _batch(n: int) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(7)
    x = g.normal(size=(4 * n, 4)).astype(np.float32)
    return x, np.sin(x.sum(-1, keepdims=True)).astype(np.float32)


def _same_as_whole_batch_sgd(got, x, y) -> bool:
    """Whether parameters ``got`` are two SGD steps (lr 0.1) on the whole batch, computed
    in this process."""
    graph, params, rest = nnx.split(Net(nnx.Rngs(0)), nnx.Param, ...)

    @jax.jit
    def sgd(params, batch):
        grads = jax.grad(lambda p: loss_fn(nnx.merge(graph, p, rest), batch))(params)
        return jax.tree.map(lambda p, d: p - 0.1 * d, params, grads)

    want = params
    for _ in range(2):
        want = sgd(want, {"x": x, "y": y})
    return all(allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
               for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))


def ddp_step(me: int, n: int, mpi: bool) -> None:
    """Two DDP steps on this rank's quarter of the batch == two steps on the whole batch."""
    from jaxpg.ddp import DistributedDataParallel

    x, y = _batch(n)
    ddp = DistributedDataParallel(Net(nnx.Rngs(0)), optax.sgd(0.1))
    for _ in range(2):
        ddp.train_step(loss_fn, {"x": x[4 * me: 4 * me + 4], "y": y[4 * me: 4 * me + 4]})
    check("ddp_step", _same_as_whole_batch_sgd(nnx.state(ddp.module, nnx.Param), x, y))


def fsdp_step(me: int, n: int, mpi: bool) -> None:
    """Two FSDP (stage 3) steps on this rank's quarter of the batch == two steps on the
    whole batch."""
    from jaxpg.fsdp import FullyShardedDataParallel

    x, y = _batch(n)
    fsdp = FullyShardedDataParallel(Net(nnx.Rngs(0)), optax.sgd(0.1), zero_stage=3)
    for _ in range(2):
        fsdp.train_step(loss_fn, {"x": x[4 * me: 4 * me + 4], "y": y[4 * me: 4 * me + 4]})
    check("fsdp_step", _same_as_whole_batch_sgd(fsdp.full_params(), x, y))


def pipeline_step(me: int, n: int, mpi: bool) -> None:
    """A 1F1B step over every process (one stage each) == the un-pipelined model."""
    import pipeline_worker as w
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()), ("pp",))
    loss, grads = w.run(mesh, "1f1b")
    grads = multihost_utils.process_allgather(grads, tiled=True)
    params, x, t = w.data()
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(
        lambda p: w.mse(None, w.stage(p, x), t)))(params)
    ok = allclose(np.asarray(loss), ref_loss, rtol=1e-5) and all(
        allclose(np.asarray(grads[k]).reshape(ref.shape), ref, rtol=1e-4, atol=1e-5)
        for k, ref in ref_grads.items())
    check("pipeline_step", ok)


def main() -> None:
    backend = None if sys.argv[1] == "default" else sys.argv[1]
    parts = (sys.argv[2] if len(sys.argv) > 2 else "collectives,ddp,pipeline").split(",")
    start = time.monotonic()
    jaxpg.init_process_group(backend=backend)
    me, n = jaxpg.get_rank(), jaxpg.get_world_size()
    print(f"TIME init {time.monotonic() - start:.1f} s", flush=True)
    print(f"WORLD {me} {n} {jaxpg.get_backend()} local_rank="
          f"{os.environ.get('LOCAL_RANK', os.environ.get('SLURM_LOCALID', '-'))}", flush=True)
    mpi = jaxpg.get_backend() == "mpi"
    for name, part in (("world", world_sum), ("collectives", collectives), ("ddp", ddp_step),
                       ("fsdp", fsdp_step), ("pipeline", pipeline_step)):
        if name in parts:
            start = time.monotonic()
            part(me, n, mpi)
            print(f"TIME {name} {time.monotonic() - start:.1f} s", flush=True)
    jaxpg.destroy_process_group()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
