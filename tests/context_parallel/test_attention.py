"""Every method, causal or not, load-balanced or not, equals full attention (forward and the
three input gradients) at cp = 2 and 4, with the ranks stacked in one process."""

import itertools

import jax
import numpy as np
import pytest
from _attention_reference import full_attention
from jax.sharding import PartitionSpec as P

import jaxpg
from jaxpg import context_parallel as cp_

CASES = list(itertools.product(("ring", "all_to_all", "all_gather"), (False, True),
                               (False, True)))
B, S, H, D = 2, 16, 4, 8


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, S, H, D)).astype(np.float32) for _ in range(4)]


@pytest.mark.parametrize("n,form", [(2, "mesh"), (4, "group")])
def test_every_method_equals_full_attention_inside_spmd(n, form):
    # cp = 2: one dimension of a ("dp", "cp") mesh, under spmd(mesh=...); cp = 4: a 1-D
    # group under spmd(group=...). One jitted program runs all 12 cases.
    if form == "mesh":
        mesh = jaxpg.init_device_mesh((8 // n, n), ("dp", "cp"))
        group = mesh["cp"].get_group()
    else:
        group = jaxpg.new_group(list(range(n)))
    q, k, v, w = _inputs()
    sharded = {lb: [cp_.shard_sequence(a, group, load_balance=lb).x for a in (q, k, v, w)]
               for lb in (False, True)}

    def per_rank(*arrays):
        out = []
        for method, causal, lb in CASES:
            qs, ks, vs, ws = arrays[4 * lb: 4 * lb + 4]
            o, vjp = jax.vjp(lambda a, b, c, m=method, ca=causal, lb=lb: cp_.attention(
                a, b, c, group=group, causal=ca, method=m, load_balance=lb), qs, ks, vs)
            out.append((o, *vjp(ws)))
        return out

    if form == "group":
        run = jax.jit(jaxpg.spmd(per_rank, group=group))
    else:
        def stacked(*arrays):
            return jax.tree.map(lambda a: a[None], per_rank(*(a[0] for a in arrays)))

        run = jax.jit(jaxpg.spmd(stacked, mesh=mesh, in_specs=P("cp"), out_specs=P("cp")))
    results = run(*sharded[False], *sharded[True])
    for (method, causal, lb), got in zip(CASES, results):
        want = full_attention(q, k, v, causal, w)
        for name, g, ref in zip(("o", "dq", "dk", "dv"), got, want):
            full = np.asarray(cp_.unshard_sequence(g, group, load_balance=lb))
            np.testing.assert_allclose(full, ref, rtol=1e-5, atol=1e-5,
                                       err_msg=f"{name} {method} causal={causal} lb={lb}")


def test_host_call_in_one_process_is_differentiable():
    # From host code the stacked shards go in and out; jax.grad flows through.
    group = jaxpg.init_device_mesh((2, 4), ("dp", "cp"))["cp"]  # a 1-D DeviceMesh
    q, k, v, w = _inputs(1)
    xs = [cp_.shard_sequence(a, group, load_balance=True) for a in (q, k, v, w)]

    def loss(q, k, v):
        o = cp_.attention(q, k, v, group=group, causal=True)
        return (o * xs[3].x).sum(), o

    (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        xs[0].x, xs[1].x, xs[2].x)
    want = full_attention(q, k, v, True, w)
    for g, ref in zip((o, *grads), want):
        full = cp_.unshard_sequence(g, group, layout=xs[0].layout)
        np.testing.assert_allclose(np.asarray(full), ref, rtol=1e-5, atol=1e-5)


def test_grouped_query_attention_equals_full_attention_with_repeated_heads():
    # K/V with fewer heads (2 and 4 of 8 query heads at cp = 4: the all-to-all repeats the
    # 2 heads to 4 and sends the 4 as they are; the ring and all-gather never repeat). The
    # reference repeats each K/V head over its query group and sums dK/dV back over it.
    group = jaxpg.new_group(list(range(4)))
    rng = np.random.default_rng(3)
    heads = 8
    q, w = (rng.standard_normal((B, S, heads, D)).astype(np.float32) for _ in range(2))
    kvs = {g: [rng.standard_normal((B, S, g, D)).astype(np.float32) for _ in range(2)]
           for g in (2, 4)}
    cases = [(m, g) for m in ("ring", "all_to_all", "all_gather") for g in (2, 4)]

    def shard(a):
        return cp_.shard_sequence(a, group, load_balance=True).x

    def per_rank(q, w, *kv):
        out = []
        for method, g in cases:
            k, v = kv[0:2] if g == 2 else kv[2:4]
            o, vjp = jax.vjp(lambda a, b, c, m=method: cp_.attention(
                a, b, c, group=group, causal=True, method=m), q, k, v)
            out.append((o, *vjp(w)))
        return out

    run = jax.jit(jaxpg.spmd(per_rank, group=group))
    results = run(shard(q), shard(w), *(shard(a) for g in (2, 4) for a in kvs[g]))
    for (method, g), got in zip(cases, results):
        rep = heads // g
        k, v = (np.repeat(a, rep, axis=2) for a in kvs[g])
        o, dq, dk, dv = full_attention(q, k, v, True, w)
        dk, dv = (a.reshape(B, S, g, rep, D).sum(3) for a in (dk, dv))
        for name, a, ref in zip(("o", "dq", "dk", "dv"), got, (o, dq, dk, dv)):
            full = np.asarray(cp_.unshard_sequence(a, group, load_balance=True))
            assert full.shape == ref.shape, (name, full.shape, ref.shape)
            np.testing.assert_allclose(full, ref, rtol=1e-5, atol=1e-5,
                                       err_msg=f"{name} {method} kv_heads={g}")


def test_the_ring_sends_grouped_query_kv_heads_once():
    # the forward's collective-permutes carry cp - 1 blocks of K and V with their own 2
    # heads, not the 8 query heads: 4x fewer bytes than K/V repeated to the query heads
    from jaxpg.internal import collective_bytes

    n, heads, kv = 4, 8, 2
    group = jaxpg.new_group(list(range(n)))
    q = np.zeros((n, B, S // n, heads, D), np.float32)
    k = np.zeros((n, B, S // n, kv, D), np.float32)
    run = jax.jit(jaxpg.spmd(lambda a, b, c: cp_.attention(a, b, c, group=group, causal=True),
                             group=group))
    sent = collective_bytes(run.lower(q, k, k).compile())["collective-permute"]
    block = B * (S // n) * kv * D * 4  # one rank's K (or V) shard, float32
    assert sent == (n - 1) * 2 * block, (sent, block)
