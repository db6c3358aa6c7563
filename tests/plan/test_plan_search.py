"""The candidates, the ranking, the JSON record, ParallelDims, and the command line."""

from __future__ import annotations

import json

import pytest

from jaxpg.pipeline.schedule.builders import get_schedule
from jaxpg.pipeline.schedule.costs import ActionCosts, timed
from jaxpg.plan import (
    JSON_KEYS,
    Job,
    Layout,
    candidates,
    evaluate,
    get_model,
    problems,
    search,
    step_time,
)
from jaxpg.plan.cli import main
from jaxpg.plan.hardware import Link, get_hardware
from jaxpg.plan.job import DTYPE_BYTES
from jaxpg.plan.links import collective_time, span
from jaxpg.plan.memory import param_split
from jaxpg.plan.step_time import _makespan, block_kernels


def _job(model="llama3-8b", devices=32, **kw):
    base = dict(model=get_model(model), devices=devices, hardware="h100-80gb", seq_len=4096,
                global_batch=64)
    return Job(**{**base, **kw})


def test_every_candidate_uses_the_devices_and_passes_the_structural_checks():
    job = _job()
    seen = list(candidates(job))
    assert len(seen) > 500
    assert all(lay.devices == job.devices for lay in seen)
    assert all(problems(lay, job, memory=False) == [] for lay in seen[::7])
    degrees = {(lay.tp, lay.pp, lay.cp) for lay in seen}
    assert {(8, 1, 1), (1, 2, 1), (1, 1, 2), (2, 4, 4)} <= degrees
    assert {lay.schedule for lay in seen} == {"none", "1f1b", "interleaved_1f1b", "zb_h1"}
    assert {lay.remat for lay in seen} == {"none", "selective", "full"}
    assert {lay.zero for lay in seen} == {0, 1, 2, 3}


def test_moe_candidates_vary_ep_within_dp_shard_x_cp():
    job = _job("qwen3-30b-a3b", devices=16, global_batch=32)
    eps = {(lay.ep, lay.dp_shard * lay.cp) for lay in candidates(job)}
    assert {e for e, _ in eps} >= {1, 2, 4, 8, 16}
    assert all(shard % e == 0 for e, shard in eps)


def test_search_ranks_fitting_layouts_by_step_time_and_top_is_exact():
    job = _job(devices=8, global_batch=32)
    everything = search(job)
    assert everything and all(e.fits for e in everything)
    times = [e.step_s for e in everything]
    assert times == sorted(times) or max(
        abs(a - b) / b for a, b in zip(times, sorted(times))) < 1e-3
    top = search(job, top=5)
    assert [str(e.layout) for e in top] == [str(e.layout) for e in everything[:5]]


def test_json_records_have_the_keys_and_build_parallel_dims():
    best = search(_job(), top=3)
    for est in best:
        record = est.to_json()
        assert list(record)[:len(JSON_KEYS)] == list(JSON_KEYS)
        json.dumps(record)
        dims = est.parallel_dims()  # no live world: world_size is passed
        assert dims.product == 32 and dims.tp == est.layout.tp and dims.pp == est.layout.pp
        assert record["memory_gib"] == pytest.approx(est.memory.total_gib, abs=1e-3)
        assert record["mfu"] == pytest.approx(
            est.tokens_per_s_per_device * get_model("llama3-8b").train_flops_per_token(4096)
            / 989e12)


def test_a_layout_that_does_not_fit_is_evaluated_and_says_so():
    est = evaluate(Layout(dp_replicate=32, microbatches=1), _job())
    assert not est.fits and est.memory.total_gib > 72 and est.step_s > 0
    assert "DOES NOT RUN" in est.summary() and "[memory]" in est.summary()


def test_alpha_beta_costs():
    link = get_hardware("a100-80gb").intra
    nbytes, n = 1e9, 8
    assert collective_time("all_reduce", nbytes, n, link, 1.0) == pytest.approx(
        2 * 7 * link.latency + 2 * 7 / 8 * nbytes / link.bandwidth)
    assert collective_time("all_gather", nbytes, n, link, 0.5) == pytest.approx(
        7 * link.latency + 7 / 8 * nbytes / (0.5 * link.bandwidth))
    assert collective_time("all_reduce", nbytes, 1, link, 1.0) == 0.0
    lay = Layout(dp_shard=4, cp=2, tp=8, pp=2)
    assert span(lay, ("tp",)) == 8 and span(lay, ("cp",)) == 16
    assert span(lay, ("dp_shard", "cp")) == 64 and span(lay, ("pp",)) == 128


@pytest.mark.parametrize("schedule, p, m", [("1f1b", 4, 8), ("interleaved_1f1b", 4, 8),
                                            ("zb_h1", 4, 8), ("1f1b", 8, 8)])
def test_the_bubble_is_the_timetable_replay_s(schedule, p, m):
    v = 2 if schedule == "interleaved_1f1b" else 1
    tt = get_schedule(schedule, p, m, v)
    for b, w in [(2.0, 1.0), (2.6, 1.3), (3.1, 0.9)]:
        direct = timed(tt, ActionCosts(1.0, b, w if tt.split_backward else 0.0)).makespan
        assert _makespan(schedule, p, m, v, b, w)[0] == pytest.approx(direct, rel=0.01)
    if schedule == "1f1b":  # 1F1B's bubble: (p - 1) (F + B)
        assert _makespan(schedule, p, m, 1, 2.3, 0.0)[0] == pytest.approx((m + p - 1) * 3.3)


def test_time_model_moves_the_right_way():
    job = _job(devices=8, global_batch=16)
    base = Layout(dp_shard=8, microbatches=2, zero=1)
    t = lambda **kw: step_time(job, base.replace(**kw)).total  # noqa: E731
    assert t(remat="none") < t(remat="selective") < t(remat="full")
    deep = Layout(pp=8, microbatches=16, remat="full")
    few = step_time(job.replace(global_batch=8), deep.replace(microbatches=8))
    many = step_time(job.replace(global_batch=64), deep.replace(microbatches=64))
    assert few.bubble / few.total > many.bubble / many.total  # more microbatches: less bubble
    slow_links = job.replace(hardware=get_hardware("h100-80gb").replace(
        intra=get_hardware("a100-80gb").inter))
    tp8 = Layout(tp=8, microbatches=16)
    assert step_time(slow_links, tp8).comm["tp"] > 5 * step_time(job, tp8).comm["tp"]
    fsdp = Layout(dp_shard=8, microbatches=2, zero=3)
    serial = job.replace(hardware=job.hardware.replace(overlap=False))
    assert step_time(serial, fsdp).comm["zero3"] > 3 * step_time(job, fsdp).comm["zero3"]
    # each FSDP unit (a block, the root) is one collective: 3 per microbatch (2 gathers,
    # 1 scatter), each paying the latency at each of its 7 ring steps
    latency = 1e-3
    laggy = serial.replace(hardware=serial.hardware.replace(
        intra=Link(bandwidth=serial.hardware.intra.bandwidth, latency=latency)))
    extra = step_time(laggy, fsdp).comm["zero3"] - step_time(serial, fsdp).comm["zero3"]
    units = job.model.layers + 1
    assert extra == pytest.approx(3 * 2 * units * 7 * (latency - job.hardware.intra.latency))
    # where the compiler leaves them one per parameter tensor (XLA:CPU), each tensor's: a
    # block's 9 (q, k, v, o, gate, up, down, two norms) and the embedding, norm and head
    apart = lambda j: j.replace(hardware=j.hardware.replace(  # noqa: E731
        per_tensor_collectives=True))
    extra = (step_time(apart(laggy), fsdp).comm["zero3"]
             - step_time(apart(serial), fsdp).comm["zero3"])
    tensors = job.model.layers * 9 + 3
    assert extra == pytest.approx(3 * 2 * tensors * 7 * (latency - job.hardware.intra.latency))


def test_each_zero_stage_prices_the_collectives_its_step_runs():
    # ZeRO-1 all-reduces the whole gradient as DDP does (jaxpg's stage 1, torch's
    # ZeroRedundancyOptimizer), then gathers the updated parameters back; ZeRO-2 reduce-
    # scatters the gradients with the backward instead
    job = _job(devices=8, global_batch=16)
    job = job.replace(hardware=job.hardware.replace(overlap=False))  # every second exposed
    hw = job.hardware
    ddp = step_time(job, Layout(dp_replicate=8)).comm
    zero1 = step_time(job, Layout(dp_shard=8, zero=1)).comm
    zero2 = step_time(job, Layout(dp_shard=8, zero=2)).comm
    nbytes = param_split(job, Layout(dp_shard=8, zero=1)).total * DTYPE_BYTES[job.grad_dtype]
    assert zero1["dp"] == pytest.approx(ddp["dp"])
    assert zero1["dp"] == pytest.approx(collective_time("all_reduce", nbytes, 8, hw.intra,
                                                        hw.collective_efficiency))
    assert "dp" not in zero2 and zero2["zero2"] > 0
    assert zero1["zero_gather"] == pytest.approx(zero2["zero_gather"])


def test_each_kernel_and_the_gradient_accumulation_are_priced():
    job = _job(devices=8, global_batch=16)
    spec, hw = job.model, job.hardware
    assert hw.op_overhead == 0  # the presets leave it out
    costly = job.replace(hardware=hw.replace(op_overhead=1e-3))
    t = lambda j, **kw: step_time(j, Layout(dp_replicate=8, **kw)).total  # noqa: E731
    # a SwiGLU block's forward: 9 matmuls (7 weights', attention's 2), an elementwise
    # kernel after each, 2 per norm, 4 for the mask and softmax
    assert block_kernels(spec, moe=False) == 26
    assert block_kernels(spec, moe=True) == 32
    tensors = spec.layers * spec.block_tensors + 3
    actions = spec.layers * 26 + 9  # the blocks' forward kernels and the head's
    # one microbatch: forward, backward (twice), the optimizer's 3 kernels a tensor
    one = 3 * actions + 3 * tensors
    assert t(costly) - t(job) == pytest.approx(one * 1e-3, rel=1e-6)
    # full recomputation runs the forward's kernels again
    assert t(costly, remat="full") - t(job, remat="full") == pytest.approx(
        (one + actions) * 1e-3, rel=1e-6)
    # two microbatches: each runs the actions' kernels, the second adds its gradients into
    # the accumulator (a kernel a tensor, and three passes over the fp32 gradients)
    two = 2 * 3 * actions + 3 * tensors + tensors
    assert t(costly, microbatches=2) - t(job, microbatches=2) == pytest.approx(
        two * 1e-3, rel=1e-6)
    grads = param_split(job, Layout(dp_replicate=8)).total * 4
    assert t(job, microbatches=2) - t(job) == pytest.approx(3 * grads / hw.hbm_bandwidth,
                                                             rel=1e-6)


def test_cli_ranks_evaluates_and_prints_json(capsys):
    argv = ["--model", "llama3-8b", "--devices", "32", "--hardware", "h100-80gb",
            "--seq-len", "4096", "--global-batch", "64"]
    assert main(argv + ["--top", "4"]) == 0
    out = capsys.readouterr().out
    assert "llama3-8b" in out and out.count("\n") >= 6 and "MFU" in out
    assert main(argv + ["--json", "--top", "3"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert len(records) == 3 and set(JSON_KEYS) <= set(records[0])
    assert main(argv + ["--layout", "tp=8,remat=full"]) == 0  # dp_shard fills the rest
    out = capsys.readouterr().out
    assert "dp_shard=4" in out and "fits" in out
    assert main(argv + ["--layout", "dp_replicate=32,microbatches=1"]) == 1
    assert "DOES NOT RUN" in capsys.readouterr().out


def test_cli_takes_sizes_and_gelu():
    argv = ["--layers", "24", "--dim", "2048", "--heads", "16", "--ffn", "8192", "--vocab",
            "50304", "--mlp", "gelu", "--devices", "8", "--hardware", "a100-80gb",
            "--seq-len", "1024", "--global-batch-tokens", "65536", "--json", "--top", "1"]
    assert main(argv) == 0
    with pytest.raises(SystemExit, match="--layers"):
        main(["--dim", "8", "--devices", "8", "--seq-len", "8", "--global-batch", "8"])
