"""Where one rank's expert-parallel step goes: jaxpg's per-rank program beside torch's, in
one process on one device, the exchange made the identity (what a rank sends itself), at
the cross-process benchmark's shapes (``bench/_expert_parallel_worker.py``).

    python bench/_expert_parallel_profile.py            # ~1 min; prints min / median ms

Each line is a whole gradient step (the loss ``sum(y · cot)`` plus the router's
probabilities, its gradients in x, the router and both expert weights) with parts swapped:
the grouped path at the first-try and the worst-case buffer sizes, a dense FFN on all the
choices instead, no experts at all; and the same program in torch (one thread), with and
without its per-expert matmuls. The difference between lines is what a part costs.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from _expert_parallel_worker import torch_experts, torch_route  # bench/ is sys.path[0]

from jaxpg.expert_parallel import dispatch as D
from jaxpg.expert_parallel.router import route

T, DIM, FFN, E, K, EP = 512, 128, 256, 8, 2, 2
LOCAL = E // EP


def _act(h):
    return jax.nn.gelu(h, approximate=True)


def _times(fn, n=30):
    fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return f"min {1e3 * np.min(ts):6.2f} ms, median {1e3 * np.median(ts):6.2f} ms"


def jaxpg_steps(arrays):
    x, g, w1, w2, cot = (jnp.asarray(a) for a in arrays)

    def make(rows, experts):
        def loss(x, g, w1, w2):
            r = route(x, g, K, True)
            xr = jnp.repeat(x, K, axis=0)
            if experts == "none":
                out = xr
            elif experts == "dense":
                out = _act(xr @ w1[0]) @ w2[0]
            else:
                row, sent = D.dispatch_rows(r.experts, jnp.ones(r.experts.shape, bool), E, EP,
                                            rows)
                out = D.exchange(xr, row, sent.reshape(EP, LOCAL), w1, w2, _act, None, EP, rows,
                                 experts)
            y = jnp.einsum("tk,tkd->td", r.weights, out.reshape(T, K, -1))
            return jnp.sum(y * cot) + 0.01 * jnp.sum(r.probs)

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
        return lambda: jax.block_until_ready(step(x, g, w1, w2))

    first, worst = int(np.ceil(1.25 * T * K / EP)), T * min(K, LOCAL)
    return {"jaxpg, tiled grouped path, first-try buffers": make(first, "tiled"),
            "jaxpg, tiled grouped path, worst-case buffers": make(worst, "tiled"),
            "jaxpg, ragged_dot, worst-case buffers": make(worst, "xla"),
            "jaxpg, one dense FFN on all choices instead": make(first, "dense"),
            "jaxpg, no experts (router, combine, loss)": make(first, "none")}


def torch_steps(arrays):
    torch.set_num_threads(1)
    x, g, w1, w2, cot = (torch.tensor(a, requires_grad=i < 4) for i, a in enumerate(arrays))

    def step(experts):
        for a in (x, g, w1, w2):
            a.grad = None
        probs, weights, flat, order = torch_route(x, g, K)
        rows = x.repeat_interleave(K, dim=0)[order]
        local = flat[order] % LOCAL  # what arrives from the EP sources, expert by expert
        perm = torch.argsort(local, stable=True)
        grouped = rows[perm]
        sizes = torch.bincount(local, minlength=LOCAL).tolist()
        out = torch_experts(grouped, sizes, w1, w2) if experts else grouped
        back = torch.empty_like(out).index_copy(0, perm, out)
        unsorted = torch.empty_like(back).index_copy(0, order, back)
        y = (weights.unsqueeze(-1) * unsorted.view(T, K, DIM)).sum(1)
        ((y * cot).sum() + 0.01 * probs.sum()).backward()

    return {"torch, per-expert matmuls": lambda: step(True),
            "torch, no experts": lambda: step(False)}


def main():
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=(T, DIM)), rng.normal(size=(DIM, E)) / np.sqrt(DIM),
              rng.normal(size=(LOCAL, DIM, FFN)) / np.sqrt(DIM),
              rng.normal(size=(LOCAL, FFN, DIM)) / np.sqrt(FFN), rng.normal(size=(T, DIM))]
    arrays = [a.astype(np.float32) for a in arrays]
    for name, fn in {**jaxpg_steps(arrays), **torch_steps(arrays)}.items():
        print(f"{name:48s} {_times(fn)}", flush=True)


if __name__ == "__main__":
    main()
