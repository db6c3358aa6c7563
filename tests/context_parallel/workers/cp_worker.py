"""Context-parallel attention with one rank per process (4 processes under jaxpg-run).

Every process builds the full inputs (same seed) and the numpy reference, and compares its
own output and gradient shards: cp = 4 over the world and cp = 2 as a dimension of a
("dp", "cp") mesh, every method on each, in one jitted program per mesh (the causal and
load-balance options vary across the two meshes: all 12 combinations run in-process, in
``test_attention.py``, and the processes add only where the K/V blocks travel); the host
call (this process's shard in, its output shard out) for one case; the error for shards
of different lengths; and DistributedDataParallel with ``context_parallel=`` over a
("dp", "cp") = (2, 2) mesh, each process passing its data-parallel position's samples with
whole sequences, against one-device training on the whole batch. Prints ``CHECK <name> ok``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _attention_reference import full_attention  # noqa: E402
from _tiny_gpt import GPT, batches, loss_fn, one_device  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpg  # noqa: E402
from jaxpg import context_parallel as cp_  # noqa: E402
from jaxpg.ddp import DistributedDataParallel  # noqa: E402

CASES = {  # (method, causal, load_balance): each method twice, each option both ways
    4: [("ring", True, True), ("all_to_all", True, False), ("all_gather", False, True)],
    2: [("ring", False, False), ("all_to_all", False, True), ("all_gather", True, False)],
}
B, S, H, D = 1, 16, 4, 4
TOL = 1e-5


def check(name, cond=True):
    if not cond:
        raise AssertionError(f"{name} failed on process {jax.process_index()}")
    print(f"CHECK {name} ok", flush=True)


def inputs():
    rng = np.random.default_rng(0)
    return [rng.standard_normal((B, S, H, D)).astype(np.float32) for _ in range(4)]


def every_case(mesh, n):
    """``CASES[n]`` in one shard_map over ``mesh`` (axis "cp" of size ``n``)."""
    group = mesh["cp"].get_group()
    q, k, v, w = inputs()
    spec = P(None, "cp")
    glob = {}
    for lb in (False, True):
        for name, a in zip("qkvw", (q, k, v, w)):
            local = cp_.shard_sequence(a, group, load_balance=lb).x  # this process's shard
            glob[name, lb] = jax.make_array_from_process_local_data(
                NamedSharding(mesh.jax_mesh, spec), np.asarray(local), a.shape)

    def body(*arrays):
        out = []
        for method, causal, lb in CASES[n]:
            qs, ks, vs, ws = arrays[4 * lb: 4 * lb + 4]
            o, vjp = jax.vjp(lambda a, b, c, m=method, ca=causal, lb=lb: cp_.attention(
                a, b, c, group=group, causal=ca, method=m, load_balance=lb), qs, ks, vs)
            out.append((o, *vjp(ws)))
        return out

    args = [glob[name, lb] for lb in (False, True) for name in "qkvw"]
    results = jax.jit(jax.shard_map(body, mesh=mesh.jax_mesh, in_specs=spec, out_specs=spec,
                                    check_vma=False))(*args)
    for (method, causal, lb), got in zip(CASES[n], results, strict=True):
        want = full_attention(q, k, v, causal, w)
        for g, ref in zip(got, want):
            local = np.asarray(g.addressable_shards[0].data)
            full = np.asarray(cp_.unshard_sequence(local, group, load_balance=lb))
            np.testing.assert_allclose(full, ref, rtol=TOL, atol=TOL,
                                       err_msg=f"cp={n} {method} causal={causal} lb={lb}")
    check(f"every_method_fwd_and_grads_cp{n}")


def host_call(group, n):
    q, k, v, w = inputs()
    shards = [cp_.shard_sequence(a, group, load_balance=True) for a in (q, k, v)]
    o = cp_.attention(*(s.x for s in shards), group=group, causal=True, method="ring")
    full = np.asarray(cp_.unshard_sequence(o, group, layout=shards[0].layout))
    np.testing.assert_allclose(full, full_attention(q, k, v, True, w)[0], rtol=TOL, atol=TOL)
    check(f"host_call_own_shard_cp{n}")


def uneven_shards(group):
    seq_local = 4 if jaxpg.get_rank() else 2
    q = np.zeros((1, seq_local, 4, 4), np.float32)
    try:
        cp_.attention(q, q, q, group=group)
    except ValueError as err:
        check("uneven_shards_refused", "shards of different shapes" in str(err))
    else:
        raise AssertionError("shards of different lengths were not refused")


def ddp_with_context_parallel(mesh):
    """Two DDP steps over dp x cp; this process passes its dp position's 2 of 4 samples."""
    optimizer = optax.sgd(0.5)  # linear in the gradient: a wrong average shows
    want_losses, want_params = one_device(optimizer, steps=2, size=4)
    model = GPT(cp_.ContextParallelAttention(group=mesh["cp"], causal=True))
    ddp = DistributedDataParallel(model, optimizer, group=mesh["dp", "cp"]._flatten(),
                                  context_parallel=mesh["cp"])
    dp = mesh.get_local_rank("dp")
    losses = [float(ddp.train_step(loss_fn, {k: v[2 * dp:2 * dp + 2] for k, v in b.items()})
                    ["loss"]) for b in batches(2, 4)]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-5)
    got = jax.tree.leaves(nnx.state(ddp.module, nnx.Param))
    for a, b in zip(got, jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(np.asarray(a.addressable_shards[0].data), np.asarray(b),
                                   rtol=1e-4, atol=1e-5)
    check("ddp_dp2_cp2_equals_one_device")


def main():
    jaxpg.init_process_group()
    world = jaxpg.init_device_mesh((4,), ("cp",))
    every_case(world, 4)
    dp_cp = jaxpg.init_device_mesh((2, 2), ("dp", "cp"))
    every_case(dp_cp, 2)
    host_call(world["cp"].get_group(), 4)
    uneven_shards(world["cp"].get_group())
    ddp_with_context_parallel(dp_cp)
    jaxpg.destroy_process_group()


if __name__ == "__main__":
    main()
