"""Moving tensors between placements in SPMD code, against numpy: every pair of
Replicate, Shard(d) and Partial, forward values and gradients (Megatron's convention:
the gradient of a replicated value is complete on every rank)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpg.tensor_parallel import Partial, Replicate, Shard
from jaxpg.tensor_parallel.redistribute import redistribute_local

PLACEMENTS = [Replicate(), Shard(0), Shard(1), Shard(-1), Partial()]
PAIRS = [(s, d) for s, d in itertools.product(PLACEMENTS, PLACEMENTS) if not d.is_partial()]
rng = np.random.default_rng(3)
X, E, W = (rng.normal(size=(4, 8, 12)).astype(np.float32) for _ in range(3))


def _local(value, placement, r, n):
    """Rank r's part of a global value laid out by placement (numpy)."""
    if placement.is_shard():
        return np.split(value, n, axis=placement.dim)[r]
    return value


def _partial(x, e, r, n):
    return x / n + (r - (n - 1) / 2) * e  # the ranks' summands add up to x


def test_every_pair_of_placements_matches_numpy(mesh):
    n = mesh.size("tp")

    def body(x, e, w):
        r = jax.lax.axis_index("tp")
        outs = []
        for src, dst in PAIRS:
            if src.is_partial():
                local = _partial(x, e, r, n)
            elif src.is_shard():
                c = x.shape[src.dim] // n
                local = jax.lax.dynamic_slice_in_dim(x, r * c, c, src.dim)
            else:
                local = x
            w_local = w
            if dst.is_shard():
                c = w.shape[dst.dim] // n
                w_local = jax.lax.dynamic_slice_in_dim(w, r * c, c, dst.dim)

            def loss(v, src=src, dst=dst, w_local=w_local):
                return jnp.sum(redistribute_local(v, src, dst, "tp") * w_local)

            out = redistribute_local(local, src, dst, "tp")
            outs.append((out[None], jax.grad(loss)(local)[None]))
        return outs

    fn = jax.jit(jax.shard_map(body, mesh=mesh.jax_mesh, in_specs=(P(), P(), P()),
                               out_specs=P("tp"), check_vma=False))
    results = fn(X, E, W)
    for (src, dst), (out, grad) in zip(PAIRS, results):
        out, grad = np.asarray(out), np.asarray(grad)
        for r in range(n):
            np.testing.assert_allclose(out[r], _local(X, dst, r, n), rtol=1e-5, atol=1e-5,
                                       err_msg=f"{src} -> {dst}, rank {r}")
            want = W if src.is_partial() else _local(W, src, r, n)
            np.testing.assert_allclose(grad[r], want, rtol=1e-5, atol=1e-5,
                                       err_msg=f"gradient of {src} -> {dst}, rank {r}")
