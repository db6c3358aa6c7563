"""One rank of ``bench/expert_parallel.py --parts torch``: jaxpg's ``moe`` beside a torch
mixture of experts written with ``all_to_all_single``, in the same processes (gloo, one CPU
process per rank, ep = the world).

The torch layer is torch's dispatch pattern (as torchtitan's): each rank sorts its choices
by expert, exchanges the per-expert counts by ``all_to_all_single``, sends exactly those
rows by the autograd ``all_to_all_single`` with uneven splits, runs each local expert on its
rows, and sends the results back by the inverse exchange. The router (top-k of
``x @ gate_w``, softmax over the chosen logits), the experts (``gelu_tanh(x @ w1) @ w2``),
Switch's load-balancing loss and the loss ``sum(y · cot) + 0.01 · aux`` are the same as
jaxpg's, on the same inputs. A step is the loss and its gradients in (x, gate_w, w1, w2).

Checked before timing: both give the same loss and the same four gradients on every rank.
jaxpg runs twice: with its default first-try buffers (``buffer_factor=1.25``) and with the
worst-case buffers always (``buffer_factor=None``), which must give the same gradients.
Steps alternate round by round (``_timing.time_rounds``); the slowest rank's time counts.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from _moe import AUX_WEIGHT, moe_loss, moe_weights
from _rounds import medians, ratio_median
from _timing import join_both_worlds, leave_both_worlds, slowest_rank, time_rounds
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpg


def rank_inputs(rank, ep, args):
    """This rank's tokens and cotangent, the router, and this rank's experts (numpy)."""
    shared = np.random.default_rng(args.seed)
    d, f, e = args.dim, args.ffn, args.experts
    gate, w1, w2 = moe_weights(shared, d, f, e)
    local = e // ep
    own = np.random.default_rng([args.seed, rank])
    x = own.normal(size=(args.tokens, d)).astype(np.float32)
    cot = own.normal(size=(args.tokens, d)).astype(np.float32)
    return x, gate, w1[rank * local:(rank + 1) * local], w2[rank * local:(rank + 1) * local], cot


def jaxpg_step(ep, top_k, **moe_kwargs):
    group = jaxpg.new_group(list(range(ep)))

    loss = moe_loss(group, top_k, **moe_kwargs)

    def per_rank(x, gate_w, w1, w2, cot):
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, gate_w, w1, w2, cot)

    sharding = NamedSharding(group.family_mesh, P(group.axis_name))
    return jaxpg.spmd(per_rank, group=group), sharding


def torch_route(x, gate_w, top_k):
    """torch's router: the probabilities, the chosen experts' weights (softmax over the
    chosen logits), the choices flattened and their order sorted by expert."""
    logits = x @ gate_w
    top_logits, chosen = logits.topk(top_k, dim=-1)
    flat = chosen.reshape(-1)
    return logits.softmax(-1), top_logits.softmax(-1), flat, torch.argsort(flat, stable=True)


def torch_experts(grouped, sizes, w1, w2):
    """Each local expert ``gelu_tanh(h @ w1[e]) @ w2[e]`` on its ``sizes[e]`` rows of
    ``grouped`` (expert-major), concatenated."""
    outs, at = [], 0
    for e, n in enumerate(sizes):
        outs.append(F.gelu(grouped[at:at + n] @ w1[e], approximate="tanh") @ w2[e])
        at += n
    return torch.cat(outs)


def torch_loss(x, gate_w, w1, w2, cot, top_k, ep):
    """torch's MoE layer over the world (the per-rank program), dropless."""
    tokens, d = x.shape
    experts = gate_w.shape[1]
    local = experts // ep
    probs, weights, flat, order = torch_route(x, gate_w, top_k)
    counts = torch.bincount(flat, minlength=experts)
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts)  # [source, local expert]: counts first
    send_splits = counts.view(ep, local).sum(1).tolist()
    from_source = received_counts.view(ep, local)
    recv_splits = from_source.sum(1).tolist()
    rows = x.repeat_interleave(top_k, dim=0)[order]
    received = fc.all_to_all_single_autograd(rows, recv_splits, send_splits,
                                             dist.group.WORLD)
    # Source-major to expert-major: expert e's rows from every source, in source order.
    starts = torch.cumsum(from_source.reshape(-1), 0) - from_source.reshape(-1)
    starts = starts.view(ep, local)
    perm = torch.cat([torch.arange(int(starts[s, e]), int(starts[s, e] + from_source[s, e]))
                      for e in range(local) for s in range(ep)])
    grouped = received[perm]
    out = torch_experts(grouped, from_source.sum(0).tolist(), w1, w2)
    back = torch.empty_like(out).index_copy(0, perm, out)
    returned = fc.all_to_all_single_autograd(back, send_splits, recv_splits, dist.group.WORLD)
    unsorted = torch.empty_like(returned).index_copy(0, order, returned)
    y = (weights.unsqueeze(-1) * unsorted.view(tokens, top_k, d)).sum(1)
    global_counts = counts.clone()
    dist.all_reduce(global_counts)
    prob_sum = dist_nn.all_reduce(probs.sum(0))
    global_tokens = tokens * ep
    share = global_counts.to(torch.float32) / (global_tokens * top_k)
    aux = experts * torch.sum(share * prob_sum / global_tokens)
    return (y * cot).sum() + AUX_WEIGHT * aux


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--torch-port", type=int, required=True)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank, ep = join_both_worlds(args.torch_port)
    x, gate, w1, w2, cot = rank_inputs(rank, ep, args)

    step, sharding = jaxpg_step(ep, args.top_k)
    jx_args = [jax.make_array_from_process_local_data(sharding, a[None])
               for a in (x, gate, w1, w2, cot)]

    def jx():
        return step(*jx_args)

    worst_step, _ = jaxpg_step(ep, args.top_k, buffer_factor=None)

    def jx_worst():  # the exchange always at its worst-case buffers
        return worst_step(*jx_args)

    th_args = [torch.tensor(a, requires_grad=i < 4) for i, a in enumerate((x, gate, w1, w2, cot))]

    def th():
        for a in th_args[:4]:
            a.grad = None
        loss = torch_loss(*th_args, args.top_k, ep)
        loss.backward()
        return loss

    # The same loss and gradients, before any timing.
    jl, jg = jx()
    tl = th()
    mine = [np.asarray(g.addressable_shards[0].data[0]) for g in jg]
    errors = {n: float(np.max(np.abs(m - t.grad.numpy())))
              for n, m, t in zip(("x", "gate_w", "w1", "w2"), mine, th_args[:4], strict=True)}
    loss_diff = abs(float(np.asarray(jl.addressable_shards[0].data[0])) - float(tl))
    wl, wg = jx_worst()
    errors_worst = max(float(np.max(np.abs(np.asarray(a.addressable_shards[0].data[0])
                                             - np.asarray(b.addressable_shards[0].data[0]))))
                       for a, b in zip(wg, jg, strict=True))
    timed = time_rounds({"torch": th, "jaxpg": jx, "jaxpg_worst_case_buffers": jx_worst},
                        args.rounds)
    times = slowest_rank(timed)
    if rank == 0:
        med = medians(times)
        result = {"ep": ep, "experts": args.experts, "tokens_per_rank": args.tokens,
                  "dim": args.dim, "ffn": args.ffn, "top_k": args.top_k,
                  "step_ms": {k: 1e3 * v for k, v in med.items()},
                  "jaxpg_over_torch_time": med["jaxpg"] / med["torch"],
                  "jaxpg_over_torch_time_per_round_median": ratio_median(times["jaxpg"],
                                                                       times["torch"]),
                  "worst_case_buffers_over_torch_time": (med["jaxpg_worst_case_buffers"]
                                                         / med["torch"]),
                  "first_try_over_worst_case_time_per_round_median": ratio_median(
                      times["jaxpg"], times["jaxpg_worst_case_buffers"]),
                  "first_try_vs_worst_case_max_grad_difference": errors_worst,
                  **timed.loads(),
                  "rounds_ms": {k: [1e3 * t for t in v] for k, v in times.items()},
                  "rank0_max_abs_grad_difference": errors,
                  "rank0_loss_difference": loss_diff}
        with open(args.out, "w") as fh:
            json.dump(result, fh)
    ok = all(e < 1e-3 for e in errors.values()) and loss_diff < 1e-3 and errors_worst < 1e-3
    print(f"AGREE {ok} loss {loss_diff:.2e} grads {errors}", flush=True)
    leave_both_worlds()


if __name__ == "__main__":
    main()
