"""torch's PipelineStage and schedule classes across 2 and 4 processes (one launch each).

* torch's pipelining tutorial model (embedding + blocks + norm + head, 2 unequal stages, and
  4 stages): jaxpg's ``Schedule1F1B`` and ``ScheduleGPipe`` give torch pipelining's
  per-microbatch losses and every parameter gradient on the same weights and data (1e-5),
  including torch's accumulation without ``zero_grad`` (its ``scale_grads`` rule) and a
  step after an SGD update (3.11 leg, where torch is installed), and the un-pipelined
  model's (both legs); over 2 processes, its 4 stages 2 a process under
  ``ScheduleDualPipeV`` and ``ScheduleLoopedBFS`` give torch's (3.11 leg);
* every schedule class gives the un-pipelined model's losses and gradients, with stages of
  different shapes (both legs, 2 processes); stages that do not fit are named on every rank
  before anything runs;
* integer position ids and a bool mask carried between 2 stages beside the activations give
  the un-pipelined model's losses and gradients under ``Schedule1F1B`` and ``ScheduleGPipe``,
  and a stage returning a dict is named on every rank (both legs, 2 processes);
* data-parallel pipelines (dp = 2 x pp = 2, ``data_parallel_group=``) average their stage
  gradients to the whole batch's, and train with ZeroRedundancyOptimizer (ZeRO-1 and 2) as
  Adam on the whole batch (4 processes); Paddle's PipelineLayer under a
  HybridCommunicateGroup with dp = 2 or sharding = 2 trains as whole-batch SGD;
* tensor-parallel stages (pp = 2 x tp = 2, ``tensor_parallel_group=``) give the un-pipelined,
  un-sharded model's losses and gradients, in the parameters' tp-sharded layout, and an SGD
  step over them its parameters, also with two stages per process under
  ``ScheduleInterleaved1F1B`` (4 processes, the same launch);
* fully sharded stages (pp = 2 x dp_shard = 2, ``fsdp_group=``) give the un-pipelined
  model's losses, gradients and SGD step on the whole batch, their parameters and
  gradients split over dp_shard (4 processes, the same launch);
* expert-parallel stages (pp = 2 x ep = 2, ``expert_parallel_group=``, each process its half
  of the batch) give the un-pipelined model's losses, gradients and SGD step on the whole
  batch with every expert on one device, their experts split over ep (4 processes, the
  same launch);
* context-parallel stages (pp = 2 x cp = 2, ``context_parallel_group=``, ring attention,
  each process its part of every sequence and its position ids, carried between the stages)
  give the un-pipelined model's losses, gradients and SGD step with plain attention over
  each whole sequence (4 processes, the same launch);
* the same across 8 processes (one launch): fully sharded over dp_shard = 4, expert parallel
  over ep = 2 with pp = 4 unequal stages, context parallel over cp = 4; and in that launch
  stacked MoE stages through ``pipeline_value_and_grad`` over pp = 2 x dp = 4, the experts
  split over the data-parallel processes that route their rows to them.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _child_env import child_env
from _procs import finish
from _require import import_or_skip

from jaxpg.internal import free_port

WORKER = Path(__file__).parent / "workers" / "pipeline_stage_worker.py"
WORKER8 = Path(__file__).parent / "workers" / "pipeline_stage8_worker.py"
MULTI = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
         "ScheduleLoopedBFS", "ScheduleDualPipeV")
V_PLACED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")  # the last stage on rank 0
M = 4  # microbatches (the worker's)


def _close(got, want, what, tol=1e-5):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale, err_msg=what)


def _launch(out: Path, world: int) -> tuple[list[dict], list[str]]:
    """The worker on ``world`` processes: each rank's npz, and each rank's output."""
    env = child_env()
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", JAXPG_FR_BUFFER_SIZE="500")
    port, torch_port = free_port(), free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(port),
                               str(torch_port), str(out)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for r in range(world)]  # fmt: skip
    runs = finish(procs, timeout=840)
    for rc, text in runs:
        assert rc == 0 and "DONE" in text, text[-5000:]
    return [dict(np.load(out / f"rank{r}.npz")) for r in range(world)], [t for _, t in runs]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("pipeline_stage"), 2)[0]


@pytest.fixture(scope="module")
def results4(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("pipeline_stage4"), 4)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 4])
def test_tutorial_model_matches_torch_pipelining(request, world):
    import_or_skip("torch", "torch pipelining is the reference of this comparison")
    results = request.getfixturevalue("results") if world == 2 else \
        request.getfixturevalue("results4")[0]
    for r, got in enumerate(results):
        torch_keys = [k for k in got if k.startswith("torch/")]
        assert torch_keys, f"rank {r} ran no torch pipeline"
        for key in torch_keys:
            mine = "jax/" + key[len("torch/"):]
            assert mine in got, f"rank {r}: jaxpg has no {mine}"
            _close(got[mine], got[key], f"rank {r}: {key}")
        grads = [k for k in torch_keys if "/grad" in k]
        assert len(grads) >= 8, grads  # every parameter of the stage, every step
        if world == 2:  # two stages a process: every parameter of both, the losses
            # stages 0 (embedding + block) and 3 (norm + head) on rank 0 in a V, 1 and 2
            # (a block each) on rank 1; 0 and 2 on rank 0 in a loop, 1 and 3 on rank 1
            for name, counts in (("dualpipev", (7 + 4, 6 + 6)), ("loopedbfs", (7 + 6, 6 + 4))):
                held = [k for k in grads if k.startswith(f"torch/{name}/grad1/")]
                assert len(held) == counts[r], (r, name, held)
            assert ("torch/dualpipev/losses1" in got) == (r == 0), r
            assert ("torch/loopedbfs/losses1" in got) == (r == 1), r


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sched", ["1f1b", "gpipe"])
def test_tutorial_model_matches_the_un_pipelined_model(request, sched, world):
    """Schedule1F1B and ScheduleGPipe over 2 unequal stages, and 4 (int tokens in,
    [b, s, 16] between, logits out): the whole model's microbatch losses and mean
    gradients."""
    results = request.getfixturevalue("results") if world == 2 else \
        request.getfixturevalue("results4")[0]
    _close(results[-1][f"jax/{sched}/losses1"], results[0]["ref/losses1"], "losses")
    seen = 0
    for r, got in enumerate(results):
        for key, value in got.items():
            if key.startswith(f"jax/{sched}/grad1/"):
                _close(value, results[0]["ref/grad1/" + key.split("/", 3)[3]], f"rank {r} {key}")
                seen += 1
    assert seen == 1 + 3 * 6 + 4, seen  # every parameter of the model
    # each step is one numbered, completed flight-recorder record on the pipeline group,
    # the same numbers on every rank
    name, steps = {"1f1b": ("Schedule1F1B", 3), "gpipe": ("ScheduleGPipe", 1)}[sched]
    recorded = [[e for e in got[f"jax/{sched}/recorded"] if e.startswith(f"{name}.step #")]
                for got in results]
    assert len(recorded[0]) == steps and all(r == recorded[0] for r in recorded), recorded
    seqs = [int(entry.split("#")[1].split()[0]) for entry in recorded[0]]
    assert seqs == list(range(seqs[0], seqs[0] + steps)), recorded[0]
    assert all(e.startswith(f"{name}.step #") and e.endswith(" completed")
               for e in recorded[0]), recorded[0]
    if sched == "1f1b":
        for got in results:
            for key in (k for k in got if k.startswith("jax/1f1b/grad1/")):
                # no zero_grad between steps 1 and 2: torch's rule, (g1 + m g1) / m
                _close(got[key.replace("grad1", "grad2")], got[key] * (M + 1) / M, key)
        last = results[-1]
        # the third step, after an optax SGD update over stage.grads, has lower losses
        assert last["jax/1f1b/losses3"].mean() < last["jax/1f1b/losses1"].mean() - 1e-3


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", MULTI)
def test_every_schedule_class_gives_the_un_pipelined_gradients(results, name):
    ref_losses = results[0]["hetero/ref/losses"]
    # the last stage is on rank 1 in a loop (stage 3 = 2 + 1), on rank 0 in a V
    holder = results[0 if name in V_PLACED else 1]
    _close(holder[f"hetero/{name}/losses"], ref_losses, f"{name} losses")
    seen = 0
    for got in results:
        for key, value in got.items():
            if key.startswith(f"hetero/{name}/piece"):
                ref = results[0]["hetero/ref/" + key[len(f"hetero/{name}/"):]]
                _close(value, ref, key)
                seen += 1
    # pieces: embedding + block (7 arrays), 2 dense (2 each), head (4): all compared
    assert seen == 7 + 2 + 2 + 4, seen


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_paddle_pipeline_layer_trains_as_the_un_pipelined_model(results):
    """PipelineLayer(seg_method="layer:PBlock") over [embed, 4 blocks, tanh, head]: 2
    blocks a stage; two train_batch SGD steps give the whole model's losses and weights."""
    np.testing.assert_array_equal(results[0]["paddle/parts"], [0, 3, 7])
    for r, got in enumerate(results):
        _close(got["paddle/losses"], got["paddle/ref_losses"], f"rank {r} losses")
        params = [k for k in got if k.startswith("paddle/params/")]
        assert len(params) == (1 + 2 * 6 if r == 0 else 2 * 6 + 2), params
        for key in params:
            _close(got[key], got["paddle/ref_params/" + key[len("paddle/params/"):]], key)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("sched", ["1f1b", "gpipe"])
def test_integer_side_inputs_travel_between_stages(results, sched):
    """Stage 0 returns (h, positions, mask), int32 per-sample position ids and a bool mask
    that both stages use: the un-pipelined model's microbatch losses and every gradient of
    both stages (the ids and mask reach stage 1, and only h's gradient comes back)."""
    ref = results[0]
    _close(results[1][f"side/{sched}/losses"], ref["side/ref/losses"], "losses")
    # positions recomputed per stage (arange) would give other losses
    assert np.abs(ref["side/ref/losses_arange"] - ref["side/ref/losses"]).max() > 1e-3
    seen = 0
    for r, got in enumerate(results):
        for key, value in got.items():
            if key.startswith(f"side/{sched}/stage{r}/"):
                _close(value, ref["side/ref/" + key.split("/", 2)[2]], f"rank {r} {key}")
                seen += 1
    assert seen == 8 + 9, seen  # embed, pos, block (6) | pos, block (6), out (2)
    errors = [str(got["side/error"]) for got in results]
    assert errors[0] == errors[1], errors
    assert re.search(r"Schedule1F1B \(pipeline rank 0\): stage 0 \(DictOut\) returns a dict "
                     r"with keys \['h'\], not an array or a tuple of arrays; return an array "
                     r"or a tuple of arrays.*found by rank 0 before the step ran", errors[0]), \
        errors[0]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_stages_that_do_not_fit_are_named_on_every_rank(results):
    """Stage 0 gives [2, 16], stage 1 takes 12 features: both ranks raise the same
    ValueError naming both stages and the shapes before anything runs (rank 1 raised
    JAX's dot_general error, rank 0 a DistNetworkError), and the world goes on; so does a
    target that does not fit the loss on the last stage's output."""
    errors = [str(got["mismatch/error"]) for got in results]
    assert errors[0] == errors[1], errors
    assert re.search(r"Schedule1F1B \(pipeline rank 1\): stage 1 \(Wide\) cannot take stage "
                     r"0's output \(pipeline rank 0\), float32\[2,16\]: TypeError: dot_general"
                     r".*\(16,\) and \(12,\).*make stage 0's output fit stage 1's input.*"
                     r"found by rank 1 before the step ran", errors[0]), errors[0]
    errors = [str(got["mismatch/loss_error"]) for got in results]
    assert errors[0] == errors[1], errors
    assert re.search(r"Schedule1F1B \(pipeline rank 1\): loss_fn cannot take stage 1's output "
                     r"float32\[2,4\] with a target microbatch of float32\[2,5\]: TypeError: "
                     r".*make the last stage's output and the target fit the loss.*found by "
                     r"rank 1 before the step ran", errors[0]), errors[0]
    for got in results:
        np.testing.assert_array_equal(got["mismatch/after"], [3.0])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_paddle_pipeline_layer_averages_over_its_hybrid_groups_replicas(results4):
    """PipelineLayer under HybridCommunicateGroup(dp_degree=2, pp_degree=2) and
    (sharding_degree=2, pp_degree=2), each replica on its half of the batch: two SGD
    train_batch steps give every stage whole-batch SGD's parameters, each replica its
    half's losses (each replica trained apart before: its own half's SGD)."""
    for rank, text in enumerate(results4[1]):
        checks = {c for c in re.findall(r"^CHECK (\w+) ok$", text, re.M)
                  if c.startswith("layer_")}
        want = {f"layer_{n}_{c}" for n in ("dp", "sharding")
                for c in ("replica_losses", "params_equal_whole_batch_sgd")}
        assert checks == want, (rank, checks, text[-3000:])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_data_parallel_pipelines_average_their_stage_gradients(results4):
    """dp = 2 pipelines of 2 stages over 4 processes (``data_parallel_group=mesh["dp"]``):
    two 1F1B steps give every stage the whole batch's gradients and each replica its own
    microbatch losses; Adam through ZeroRedundancyOptimizer between them (ZeRO-1, and
    ZeRO-2 on the replicas' own gradients) ends at whole-batch Adam's parameters
    (pipeline_stage_dp_worker.py)."""
    for rank, text in enumerate(results4[1]):
        checks = {c for c in re.findall(r"^CHECK (\w+) ok$", text, re.M)
                  if not c.startswith(("tp_", "layer_"))}  # the tp stages' and layers' own
        want = {"dp_averaged_grads_step0", "dp_averaged_grads_step1",
                "zero1_adam_equals_whole_batch", "zero2_adam_equals_whole_batch"}
        if rank % 2:  # the last stage's processes: their replica's losses
            want |= {"replica_losses_step0", "replica_losses_step1"}
        assert checks == want, (rank, checks, text[-3000:])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tensor_parallel_stages_give_the_un_sharded_gradients(results4):
    """pp = 2 stages, each tensor parallel over its 2 processes (``("pp", "tp")`` mesh,
    ``tensor_parallel_group=mesh["tp"]``): a Schedule1F1B step, an SGD step over
    ``stage.grads`` and a ScheduleGPipe step give the whole model's microbatch losses (on
    both tp ranks of the last stage), gradients (gathered from their tp shards, which keep
    the parameters' layout) and SGD parameters; then a ScheduleInterleaved1F1B step over 4
    tensor-parallel stages, two per process, gives the un-sharded chain's gradients
    (pipeline_stage_tp_worker.py)."""
    for rank, text in enumerate(results4[1]):
        checks = {c for c in re.findall(r"^CHECK (\w+) ok$", text, re.M) if c.startswith("tp_")}
        want = {"tp_grads_1f1b", "tp_grads_keep_the_param_layout", "tp_sgd_params",
                "tp_grads_gpipe", "tp_interleaved_grads"}
        if rank >= 2:  # the last stage's processes (pp coordinate 1)
            want |= {"tp_losses_1f1b", "tp_losses_gpipe"}
        assert checks == want, (rank, checks, text[-3000:])


@pytest.fixture(scope="module")
def texts8():
    """pipeline_stage8_worker.py on 8 processes: each rank's output."""
    env = child_env()
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", JAXPG_FR_BUFFER_SIZE="500")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER8), str(r), "8", str(port)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
             for r in range(8)]  # fmt: skip
    runs = finish(procs, timeout=840)
    for rc, text in runs:
        assert rc == 0 and "DONE" in text, text[-5000:]
    return [t for _, t in runs]


#: The stages whose group splits the data, by the prefix their worker's checks print
#: (pipeline_stage_tp_worker.py, _ep_worker.py, _cp_worker.py): their layout check.
SPLIT_DATA = {"FSDP": "params_split", "EP": "experts_split", "CP": "params_replicated"}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", list(SPLIT_DATA))
def test_stages_over_a_group_that_splits_the_data_give_the_un_pipelined_gradients(
        results4, kind):
    """pp = 2 stages, each over its 2 processes' group, each process feeding its part of
    the batch: fully sharded (``fsdp_group=mesh["dp_shard"]``, the parameters split over
    dp_shard, the GPipe step with ``reshard_after_forward=False``), expert parallel
    (``expert_parallel_group=mesh["ep"]``, each process its half of the rows, routed and
    exchanged by all_to_all, the experts split over ep) or context parallel
    (``context_parallel_group=mesh["cp"]``, ring attention, each process its load-balanced
    part of every sequence and its position ids, the parameters replicated). A Schedule1F1B
    step's losses and gradients, an SGD step over them and a ScheduleGPipe step must give
    the un-pipelined model's on the whole batch (every expert on one device; plain attention
    over each whole sequence), the layout kept."""
    layout = SPLIT_DATA[kind]
    for rank, text in enumerate(results4[1]):
        checks = set(re.findall(rf"^{kind} (\w+) ok$", text, re.M))
        want = {layout, "grads_1f1b", "sgd_params", "grads_gpipe"}
        if rank >= 2:  # the last stage's processes (pp coordinate 1)
            want |= {"losses_1f1b", "losses_gpipe"}
        assert checks == want, (rank, checks, text[-3000:])


#: The 8-process launch's layouts: (pp, the group's size) of each kind's mesh.
SPLIT_DATA8 = {"FSDP": (2, 4), "EP": (4, 2), "CP": (2, 4)}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", list(SPLIT_DATA))
def test_stages_over_a_group_that_splits_the_data_across_8_processes(texts8, kind):
    """The same stages across 8 processes: fully sharded over dp_shard = 4 (pp = 2), expert
    parallel over ep = 2 with pp = 4 unequal stages (two middle ones that only receive and
    send, 4 microbatches), context parallel over cp = 4 (pp = 2, a quarter of every
    sequence each). Each kind's Schedule1F1B step, SGD step and ScheduleGPipe step must give
    the un-pipelined model's losses, gradients and parameters on the whole batch, on every
    rank, the layout kept."""
    pp, size = SPLIT_DATA8[kind]
    for rank, text in enumerate(texts8):
        checks = set(re.findall(rf"^{kind} (\w+) ok$", text, re.M))
        want = {SPLIT_DATA[kind], "grads_1f1b", "sgd_params", "grads_gpipe"}
        if rank // size == pp - 1:  # the last stage's processes
            want |= {"losses_1f1b", "losses_gpipe"}
        assert checks == want, (rank, checks, text[-3000:])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_stacked_moe_stages_over_8_processes_route_over_the_data_parallel_ranks(texts8):
    """``pipeline_value_and_grad`` (the lockstep executor, one program over 8 processes):
    pp = 2 x dp = 4 stacked MoE stages whose dp processes each route their own rows to the
    experts split over dp give the un-pipelined model's loss and gradients, the experts'
    gradients split as their parameters."""
    for rank, text in enumerate(texts8):
        checks = set(re.findall(r"^STACKED (\w+) ok$", text, re.M))
        assert checks == {"loss", "grads", "experts_split"}, (rank, checks, text[-3000:])
