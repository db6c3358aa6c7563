"""One rank of ``bench/context_parallel.py --parts torch``: jaxpg's ring attention beside a
ring written with torch.distributed P2P (gloo), in the same processes, one CPU process per
rank, on the same load-balanced causal shards.

torch 2.13's ``context_parallel`` is not used: it replaces the flash and memory-efficient
SDPA kernels (CUDA), and on CPU SDPA takes another kernel. The torch ring is the same
algorithm as jaxpg's: rank ``i`` holds sequence chunks ``i`` and ``2·cp−1−i``; K/V travel
around the ring by ``batch_isend_irecv`` (the next block's transfer posted before the
current block is computed); each (query chunk, key chunk) pair is skipped when fully
masked, causally masked on the diagonal, full otherwise; blocks merge by an online
(log-sum-exp) softmax. Forward only: torch's P2P ops have no autograd, so a backward would
be hand-written in torch as well; the jaxpg step is forward only too, for the same figure.

Also jaxpg's ring on the contiguous layout (rank ``i`` holds chunk ``i`` of ``cp``), so the
load balance is measured where each rank has a core of its own (the slowest rank's time in
each round counts).

Checked before timing: all three equal full causal attention (numpy) on this rank's rows.
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import numpy as np
import torch
import torch.distributed as dist
from _rounds import medians, ratio_median
from _timing import join_both_worlds, leave_both_worlds, slowest_rank, time_rounds
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpg
from jaxpg import context_parallel as cp_


def full_inputs(args):
    rng = np.random.default_rng(args.seed)
    shape = (args.batch, args.seq, args.heads, args.dim)
    return [rng.normal(size=shape).astype(np.float32) for _ in range(3)]


def chunks_of(rank, cp):
    return (rank, 2 * cp - 1 - rank)


def local_rows(x, rank, cp):
    parts = np.split(x, 2 * cp, axis=1)
    return np.concatenate([parts[c] for c in chunks_of(rank, cp)], axis=1)


def reference(q, k, v):
    """Full causal softmax attention, (B, S, H, D), numpy float64."""
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), k) / math.sqrt(q.shape[-1])
    n = q.shape[1]
    s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def torch_ring(q, k, v, rank, cp):
    """This rank's causal, load-balanced output; q, k, v (B, 2c, H, D) torch tensors."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    c = q.shape[1] // 2
    qs = [q[:, :c].transpose(1, 2), q[:, c:].transpose(1, 2)]  # (B, H, c, D) per chunk
    mine = chunks_of(rank, cp)
    out = [torch.zeros_like(x) for x in qs]
    m = [torch.full(x.shape[:-1], -math.inf) for x in qs]
    lse = [torch.zeros(x.shape[:-1]) for x in qs]
    kv = torch.stack([k, v])
    tri = torch.ones(c, c, dtype=torch.bool).tril()
    for step in range(cp):
        source = (rank - step) % cp
        pending = None
        if step < cp - 1:  # the next block's transfer first, then this block's compute
            recv = torch.empty_like(kv)
            pending = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, kv, (rank + 1) % cp),
                dist.P2POp(dist.irecv, recv, (rank - 1) % cp)])
        theirs = chunks_of(source, cp)
        kc = [kv[0][:, :c].transpose(1, 2), kv[0][:, c:].transpose(1, 2)]
        vc = [kv[1][:, :c].transpose(1, 2), kv[1][:, c:].transpose(1, 2)]
        for i, qi in enumerate(mine):
            for j, kj in enumerate(theirs):
                if kj > qi:
                    continue  # fully masked
                s = torch.matmul(qs[i], kc[j].transpose(-1, -2)) * scale
                if kj == qi:
                    s = s.masked_fill(~tri, -math.inf)
                m_new = torch.maximum(m[i], s.amax(-1))
                p = torch.exp(s - m_new.unsqueeze(-1))
                corr = torch.exp(m[i] - m_new)
                lse[i] = lse[i] * corr + p.sum(-1)
                out[i] = out[i] * corr.unsqueeze(-1) + torch.matmul(p, vc[j])
                m[i] = m_new
        if pending is not None:
            for w in pending:
                w.wait()
            kv = recv
    res = [(o / s.unsqueeze(-1)).transpose(1, 2) for o, s in zip(out, lse, strict=True)]
    return torch.cat(res, dim=1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--torch-port", type=int, required=True)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank, cp = join_both_worlds(args.torch_port, torch_threads=1)
    q, k, v = full_inputs(args)
    local = [local_rows(x, rank, cp) for x in (q, k, v)]
    want = local_rows(reference(q, k, v), rank, cp)

    group = jaxpg.new_group(list(range(cp)))
    sharding = NamedSharding(group.family_mesh, P(group.axis_name))
    jx_args = [jax.make_array_from_process_local_data(sharding, x[None]) for x in local]
    # the contiguous layout: rank i holds chunk i of cp (its last rank does the most work)
    contiguous = [np.split(x, cp, axis=1)[rank] for x in (q, k, v)]
    jx_contiguous = [jax.make_array_from_process_local_data(sharding, x[None])
                     for x in contiguous]

    def ring(balanced):
        return jaxpg.spmd(lambda q, k, v: cp_.attention(
            q, k, v, group=group, causal=True, method="ring", load_balance=balanced),
            group=group)

    fwd, fwd_contiguous = ring(True), ring(False)
    th_args = [torch.from_numpy(x) for x in local]

    def jx():
        return fwd(*jx_args)

    def jx_contig():
        return fwd_contiguous(*jx_contiguous)

    def th():
        with torch.no_grad():
            return torch_ring(*th_args, rank, cp)

    errors = {"jaxpg": float(np.max(np.abs(np.asarray(jx().addressable_shards[0].data[0])
                                           - want))),
              "torch": float(np.max(np.abs(th().numpy() - want))),
              "jaxpg contiguous": float(np.max(np.abs(
                  np.asarray(jx_contig().addressable_shards[0].data[0])
                  - np.split(reference(q, k, v), cp, axis=1)[rank])))}
    timed = time_rounds({"torch": th, "jaxpg": jx, "jaxpg contiguous": jx_contig}, args.rounds)
    times = slowest_rank(timed)
    if rank == 0:
        med = medians(times)
        with open(args.out, "w") as fh:
            json.dump({"cp": cp, "seq": args.seq, "batch": args.batch, "heads": args.heads,
                       "head_dim": args.dim, "torch_threads": 1,
                       "forward_ms": {k_: 1e3 * t for k_, t in med.items()},
                       "jaxpg_over_torch_time": med["jaxpg"] / med["torch"],
                       "jaxpg_over_torch_time_per_round_median": ratio_median(
                           times["jaxpg"], times["torch"]),
                       "balanced_over_contiguous_per_round_median": ratio_median(
                           times["jaxpg"], times["jaxpg contiguous"]), **timed.loads(),
                       "rounds_ms": {k_: [1e3 * x for x in t] for k_, t in times.items()},
                       "rank0_max_abs_error_vs_full_attention": errors}, fh)
    print(f"AGREE {max(errors.values()) < 1e-4} {errors}", flush=True)
    leave_both_worlds()


if __name__ == "__main__":
    main()
