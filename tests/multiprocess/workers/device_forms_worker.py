"""The forms of every API that takes devices, one device per process (under jaxpg-run),
each checked against a local reference. Prints ``CHECK <name> ok``; a mismatch raises."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: _arrays

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _arrays import allclose
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpg
from jaxpg.ddp import DistributedDataParallel
from jaxpg.fsdp import FullyShardedDataParallel
from jaxpg.pipeline import StagedParams, pipeline_value_and_grad
from jaxpg.tensor_parallel import ColwiseParallel, parallelize_module

ORDER = ("dp_replicate", "pp", "dp_shard", "cp", "tp")


def check(name, cond=True):
    if not cond:
        raise AssertionError(f"{name} failed on process {jax.process_index()}")
    print(f"CHECK {name} ok", flush=True)


def close(a, b):
    return all(allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def main():
    jaxpg.init_process_group()
    rank, world = jaxpg.get_rank(), jaxpg.get_world_size()
    dims = jaxpg.ParallelDims(dp_shard=world)

    x = jnp.full((3,), rank + 1.0)
    want = np.full(3, world * (world + 1) / 2)
    got = [jaxpg.all_reduce(x, group=g) for g in (None, dims.get_group("dp_shard"), dims["dp"])]
    check("collectives", all(allclose(np.asarray(g), want) for g in got))
    f = jaxpg.spmd(lambda v: jaxpg.all_reduce(v, group=dims["dp_shard"]), mesh=dims,
                   in_specs=P(ORDER), out_specs=P(ORDER))
    out = f(jax.make_array_from_process_local_data(
        jax.sharding.NamedSharding(dims.jax_mesh, P(ORDER)), np.asarray(x)[None]))
    check("spmd_mesh", allclose(np.asarray(out.addressable_data(0))[0], want))

    k1, k2 = jax.random.split(jax.random.key(1))
    batch = {"x": jax.random.normal(k1, (4 * world, 4)), "y": jax.random.normal(k2, (4 * world, 2))}
    ref = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    grads = nnx.grad(mse)(ref, batch)
    ref_params = jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(ref, nnx.Param), grads)
    local = jax.tree.map(lambda a: a[4 * rank:4 * (rank + 1)], batch)
    for name, cls, kwargs in [("ddp_group_mesh_dp", DistributedDataParallel,
                               dict(group=dims["dp"])),
                              ("ddp_device_mesh", DistributedDataParallel,
                               dict(device_mesh=dims["dp_shard"])),
                              ("fsdp_parallel_dims", FullyShardedDataParallel, dict(group=dims))]:
        wrapper = cls(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1), **kwargs)
        wrapper.train_step(mse, local)
        check(name, close(nnx.state(wrapper.module, nnx.Param), ref_params))

    tp_dims = jaxpg.ParallelDims(tp=world)
    xs = jax.random.normal(jax.random.key(2), (3, 4))
    dense = nnx.Linear(4, 2 * world, rngs=nnx.Rngs(0))
    for name, form in [("tp_mesh", tp_dims["tp"]), ("tp_parallel_dims", tp_dims)]:
        model = parallelize_module(nnx.Linear(4, 2 * world, rngs=nnx.Rngs(0)), form,
                                   ColwiseParallel())
        y = jax.jit(lambda m, v: m(v), out_shardings=jax.sharding.NamedSharding(
            tp_dims.jax_mesh, P()))(model, xs)
        check(name, allclose(np.asarray(y.addressable_data(0)), np.asarray(dense(xs)),
                                rtol=1e-5, atol=1e-6))

    ws = jax.random.normal(jax.random.key(3), (world, 3, 3)) * 0.5
    xp, tp_ = jax.random.normal(jax.random.key(4), (4, 3)), jax.random.normal(jax.random.key(5),
                                                                              (4, 3))

    def block(w, h):
        return jnp.tanh(h @ w)

    def head_loss(_, y, t):
        return jnp.mean((y - t) ** 2)

    def reference(ws):
        h = xp
        for s in range(world):
            h = block(ws[s], h)
        return head_loss((), h, tp_)

    want_loss = reference(ws)
    for name, form in [("pipeline_device_mesh", jaxpg.init_device_mesh((world,), ("pp",))),
                       ("pipeline_parallel_dims", jaxpg.ParallelDims(pp=world))]:
        loss, _ = pipeline_value_and_grad(block, head_loss, StagedParams(ws, (), ()), xp, tp_,
                                          mesh=form, schedule="gpipe", num_microbatches=2)
        check(name, allclose(float(loss), float(want_loss), rtol=1e-5))
    jaxpg.destroy_process_group()


if __name__ == "__main__":
    main()
