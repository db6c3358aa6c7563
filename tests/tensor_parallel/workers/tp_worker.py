"""Tensor parallelism with one rank per process (4 processes under jaxpg-run).

Rank 0 computes the unsharded references and gives them to every process, which compares
its own shards with the matching slices. With torch installed, it also trains the same MLP
with torch's ``parallelize_module`` (gloo, same processes, same weights and data) and
compares the parameters after 6 SGD steps. Prints ``CHECK <name> ok``; a mismatch raises, and the
launcher exits non-zero.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: _arrays

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _arrays import allclose  # noqa: E402
from _tp_models import Block, block_plan  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpg  # noqa: E402
from jaxpg.ddp import DistributedDataParallel  # noqa: E402
from jaxpg.tensor_parallel import (  # noqa: E402
    ColumnParallelLinear,
    ColwiseParallel,
    ParallelCrossEntropy,
    PrepareModuleInputOutput,
    Replicate,
    RowParallelLinear,
    RowwiseParallel,
    Shard,
    VocabParallelEmbedding,
    parallelize_module,
    param_specs,
)

TOL = 1e-4


def check(name, cond=True):
    if not cond:
        raise AssertionError(f"{name} failed on process {jax.process_index()}")
    print(f"CHECK {name} ok", flush=True)


def from_rank0(fn, *args):
    """``fn(*args)`` run by rank 0, as numpy, given to every process: a reference compiled
    once, not once a process."""
    mine = [jax.tree.map(np.asarray, fn(*args))] if jaxpg.get_rank() == 0 else [None]
    return jaxpg.broadcast_object_list(mine, src=0)[0]


def same_shards(global_array, full, tol=TOL) -> bool:
    """Every shard this process holds equals the matching slice of ``full``."""
    full = np.asarray(full)
    shards = global_array.addressable_shards
    return bool(shards) and global_array.shape == full.shape and all(
        allclose(np.asarray(s.data), full[s.index], rtol=tol, atol=tol) for s in shards)


def spmd_value_and_grad(loss, mesh, state, x, x_spec=None, reduce_loss=False):
    specs = param_specs(state)
    x_spec = P() if x_spec is None else x_spec

    def body(state, x):
        value, grads = jax.value_and_grad(loss)(state, x)
        return (jax.lax.psum(value, "tp") if reduce_loss else value), grads

    return jax.jit(jax.shard_map(body, mesh=mesh.jax_mesh, in_specs=(specs, x_spec),
                                 out_specs=(P(), specs), check_vma=False))(state, x)


class PaddleMLP(nnx.Module):
    def __init__(self, group):
        self.a = ColumnParallelLinear(8, 16, has_bias=True, gather_output=False,
                                      mp_group=group, rngs=nnx.Rngs(1))
        self.b = RowParallelLinear(16, 8, input_is_parallel=True, mp_group=group,
                                   rngs=nnx.Rngs(2))

    def __call__(self, x):
        return self.b(jax.nn.gelu(self.a(x)))


def paddle_layers(mesh4):
    g = mesh4["tp"]
    col = ColumnParallelLinear(8, 16, has_bias=True, mp_group=g, rngs=nnx.Rngs(1))
    emb = VocabParallelEmbedding(32, 8, mp_group=g, rngs=nnx.Rngs(3))
    ref_a, ref_b = nnx.Linear(8, 16, rngs=nnx.Rngs(1)), nnx.Linear(16, 8, rngs=nnx.Rngs(2))
    ref_e = nnx.Embed(32, 8, rngs=nnx.Rngs(3))
    mine = [s.data.shape for s in col.weight[...].addressable_shards]
    check("init_slices_tp4", mine == [(8, 4)] and same_shards(col.weight[...], ref_a.kernel[...])
          and same_shards(emb.weight[...], ref_e.embedding[...]))

    model = PaddleMLP(g)
    x = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
    graphdef, state = nnx.split(model)
    loss = lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x) ** 2)  # noqa: E731

    def ref_loss(w):
        return jnp.sum((jax.nn.gelu(x @ w["a"] + w["ab"]) @ w["b"] + w["bb"]) ** 2)

    w = {"a": ref_a.kernel[...], "ab": ref_a.bias[...], "b": ref_b.kernel[...],
         "bb": ref_b.bias[...]}
    want, wg = from_rank0(jax.jit(jax.value_and_grad(ref_loss)), w)
    got, g_ = spmd_value_and_grad(loss, mesh4, state, x)
    check("paddle_mlp_spmd_tp4", abs(float(got) - float(want)) < TOL * float(want)
          and same_shards(g_["a"]["weight"][...], wg["a"])
          and same_shards(g_["b"]["weight"][...], wg["b"]))
    local = model.a(x)  # host code, one rank per process: this rank's local tensor
    rank = jaxpg.get_rank()
    want_local = np.asarray(x @ w["a"] + w["ab"])[:, rank * 4:(rank + 1) * 4]
    whole = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)  # replicated output
    want_whole = from_rank0(jax.jit(lambda w: jax.nn.gelu(x @ w["a"] + w["ab"]) @ w["b"]
                                    + w["bb"]), w)
    check("paddle_host_local_output", local.shape == (4, 4)
          and allclose(np.asarray(local), want_local, atol=TOL)
          and same_shards(whole, want_whole))


def vocab_loss(mesh22):
    g = mesh22["tp"]
    emb = VocabParallelEmbedding(32, 8, mp_group=g, rngs=nnx.Rngs(3))
    head = ColumnParallelLinear(8, 32, gather_output=False, mp_group=g, rngs=nnx.Rngs(4))
    ce = ParallelCrossEntropy(mp_group=g)
    ids = np.random.default_rng(1).integers(0, 32, (4, 6)).astype(np.int32)
    labels = np.random.default_rng(2).integers(0, 32, (4, 6)).astype(np.int32)
    labels[1, :2] = -100

    class Model(nnx.Module):
        def __init__(self):
            self.emb, self.head = emb, head

        def __call__(self, ids):
            per_token = ce(self.head(self.emb(ids)), jnp.asarray(labels))
            return jnp.sum(per_token) / jnp.sum(labels != -100)

    graphdef, state = nnx.split(Model())
    ref_e, ref_h = nnx.Embed(32, 8, rngs=nnx.Rngs(3)), nnx.Linear(8, 32, rngs=nnx.Rngs(4))

    def ref_loss(w):
        keep = labels != -100
        logits = jnp.take(w["e"], ids, 0) @ w["h"]
        ce_ = optax.softmax_cross_entropy_with_integer_labels(logits, np.where(keep, labels, 0))
        return jnp.sum(jnp.where(keep, ce_, 0.0)) / keep.sum()

    want, wg = from_rank0(jax.jit(jax.value_and_grad(ref_loss)),
                          {"e": ref_e.embedding[...], "h": ref_h.kernel[...]})
    got, g_ = spmd_value_and_grad(lambda s, i: nnx.merge(graphdef, s)(i), mesh22, state, ids)
    check("vocab_parallel_cross_entropy_tp2", abs(float(got) - float(want)) < TOL
          and same_shards(g_["emb"]["weight"][...], wg["e"])
          and same_shards(g_["head"]["weight"][...], wg["h"]))


def dp_ranks_here(mesh) -> list[int]:
    """The "dp" coordinates of this process's devices on ``mesh`` (one per process when each
    process holds one rank or one whole tp group; both when tp spans the processes)."""
    axis = mesh.jax_mesh.axis_names.index("dp")
    return sorted({i[axis] for i, d in np.ndenumerate(mesh.jax_mesh.devices)
                   if d.process_index == jax.process_index()})


def ddp_sequence_parallel_block(mesh22, name="ddp_dp2_sequence_parallel_block_tp2"):
    """DDP over "dp" of a block with sequence parallelism over "tp" (whole sequences in and
    out of the block; split inside). Each process passes the rows of the dp ranks it
    holds."""
    optimizer = optax.sgd(0.05, momentum=0.9)
    model = parallelize_module(Block(16, 4, nnx.Rngs(0)), mesh22["tp"], PrepareModuleInputOutput(
        input_layouts=Replicate(), desired_input_layouts=Shard(1), output_layouts=Shard(1),
        desired_output_layouts=Replicate()))
    parallelize_module(model, mesh22["tp"], block_plan(True))
    ddp = DistributedDataParallel(model, optimizer, group=mesh22.get_group("dp"))
    graphdef, params, rest = nnx.split(Block(16, 4, nnx.Rngs(0)), nnx.Param, ...)
    opt_state = optimizer.init(params)

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    @jax.jit
    def ref_step(params, opt_state, batch):
        want, grads = jax.value_and_grad(
            lambda p: loss_fn(nnx.merge(graphdef, p, rest), batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, want

    rng = np.random.default_rng(4)
    batches = [{k: rng.normal(size=(4, 8, 16)).astype(np.float32) for k in ("x", "y")}
               for _ in range(3)]

    def reference(params, opt_state):
        for batch in batches:
            params, opt_state, want = ref_step(params, opt_state, batch)
        return jax.tree.leaves(params), want

    want_params, want = from_rank0(reference, params, opt_state)
    dp = dp_ranks_here(mesh22)
    assert dp == list(range(dp[0], dp[-1] + 1)), dp
    for batch in batches:
        mine = jax.tree.map(lambda a: a[dp[0] * 2:(dp[-1] + 1) * 2], batch)
        got = ddp.train_step(loss_fn, mine)["loss"]
    full = nnx.state(ddp.module, nnx.Param)
    check(name, abs(float(got) - float(want)) < 1e-5 and all(
        same_shards(a, b, 1e-5) for a, b in zip(jax.tree.leaves(full), want_params,
                                                  strict=True)))


class Mlp(nnx.Module):
    def __init__(self):
        self.up = nnx.Linear(8, 32, rngs=nnx.Rngs(7))
        self.down = nnx.Linear(32, 8, rngs=nnx.Rngs(8))

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def against_torch(torch_port: int):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    rank, n = jaxpg.get_rank(), jaxpg.get_world_size()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank,
                            world_size=n)
    full = nnx.state(Mlp(), nnx.Param)
    tmodel = torch.nn.Sequential()
    tmodel.add_module("up", torch.nn.Linear(8, 32))
    tmodel.add_module("relu", torch.nn.ReLU())
    tmodel.add_module("down", torch.nn.Linear(32, 8))
    with torch.no_grad():  # the same weights: torch's Linear holds the kernel transposed
        for name in ("up", "down"):
            getattr(tmodel, name).weight.copy_(torch.from_numpy(
                np.asarray(full[name]["kernel"][...]).T.copy()))
            getattr(tmodel, name).bias.copy_(torch.from_numpy(np.asarray(full[name]["bias"][...])))
    tmesh = init_device_mesh("cpu", (n,))
    torch_parallelize(tmodel, tmesh, {"up": TorchColwise(), "down": TorchRowwise()})
    topt = torch.optim.SGD(tmodel.parameters(), lr=0.1)

    mesh = jaxpg.init_device_mesh((1, n), ("dp", "tp"))
    model = parallelize_module(Mlp(), mesh["tp"], {"up": ColwiseParallel(),
                                                   "down": RowwiseParallel()})
    ddp = DistributedDataParallel(model, optax.sgd(0.1), group=mesh.get_group("dp"))

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    rng = np.random.default_rng(9)
    losses = []
    for _ in range(6):
        x, y = (rng.normal(size=(16, 8)).astype(np.float32) for _ in range(2))
        loss = ddp.train_step(loss_fn, {"x": x, "y": y})["loss"]
        tloss = torch.mean((tmodel(torch.from_numpy(x)) - torch.from_numpy(y)) ** 2)
        tloss.backward()
        topt.step()
        topt.zero_grad()
        losses.append((float(loss), float(tloss)))
    ok = all(abs(a - b) < 1e-5 for a, b in losses)
    for name in ("up", "down"):  # torch's [out, in] weights: Shard(0) for up, Shard(1) down
        tw = getattr(tmodel, name).weight.to_local().detach().numpy()
        mine = ddp.params[name]["kernel"][...].addressable_shards[0].data
        ok = ok and tw.shape == np.asarray(mine).T.shape and allclose(
            np.asarray(mine).T, tw, atol=1e-6)
        tb = getattr(tmodel, name).bias
        tb = (tb.to_local() if hasattr(tb, "to_local") else tb).detach().numpy()
        mine_b = ddp.params[name]["bias"][...].addressable_shards[0].data
        ok = ok and allclose(np.asarray(mine_b), tb, atol=1e-6)
    check("torch_parallelize_module_6_sgd_steps_tp4", ok)
    dist.destroy_process_group()


def timed(fn, *args):
    start = time.perf_counter()
    fn(*args)
    print(f"TIME {fn.__name__} {time.perf_counter() - start:.1f}s", flush=True)


def main(torch_port: int):
    jaxpg.init_process_group()
    mesh4 = jaxpg.init_device_mesh((4,), ("tp",))
    mesh22 = jaxpg.init_device_mesh((2, 2), ("dp", "tp"))
    timed(paddle_layers, mesh4)
    timed(vocab_loss, mesh22)
    timed(ddp_sequence_parallel_block, mesh22)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("SKIP torch: torch is not installed", flush=True)
    else:
        timed(against_torch, torch_port)
    jaxpg.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]))
