"""The transformer spec, its presets, the activation formulas and the memory model."""

from __future__ import annotations

import pytest

from jaxpg.pipeline.schedule.builders import get_schedule
from jaxpg.pipeline.schedule.checker import peak_in_flight
from jaxpg.plan import Job, Layout, TransformerSpec, get_hardware, get_model, memory
from jaxpg.plan.activations import block_activation_bytes
from jaxpg.plan.hardware import load_hardware, save_hardware
from jaxpg.plan.memory import in_flight_chunks

# Megatron-LM's Table 1 (Narayanan et al. 2021): its parameter counts, in billions, from
# P = 12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h)), which counts biases and positions
MEGATRON_PARAMS = {"gpt-1.7b": 1.7, "gpt-3.6b": 3.6, "gpt-7.5b": 7.5, "gpt-18b": 18.4,
                   "gpt-39b": 39.1, "gpt-76b": 76.1, "gpt-146b": 145.6, "gpt-310b": 310.1,
                   "gpt-530b": 529.6, "gpt-1t": 1008.0}
# the published totals (billions): Meta's and Qwen's model cards
PUBLISHED = {"llama3-8b": 8.03, "llama3-70b": 70.6, "llama3-405b": 405.9, "qwen3-8b": 8.19,
             "qwen3-32b": 32.8, "qwen3-30b-a3b": 30.5, "qwen3-235b-a22b": 235.1,
             "deepseek-v3-like": 671.0}


@pytest.mark.parametrize("name", sorted(MEGATRON_PARAMS))
def test_gpt_presets_have_the_paper_s_parameter_counts(name):
    spec = get_model(name)
    layers, h, v = spec.layers, spec.dim, spec.vocab
    paper = 12 * layers * h * h * (1 + 13 / (12 * h) + (v + 2048) / (12 * layers * h))
    assert spec.params == pytest.approx(paper, rel=0.01)  # no biases, no position table
    assert spec.params / 1e9 == pytest.approx(MEGATRON_PARAMS[name], rel=0.04)  # rounded


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_match_the_published_parameter_counts(name):
    assert get_model(name).params / 1e9 == pytest.approx(PUBLISHED[name], rel=0.04)


def test_moe_active_parameters_count_top_k_experts():
    spec = get_model("qwen3-30b-a3b")
    assert spec.active_params / 1e9 == pytest.approx(3.3, rel=0.05)
    # 37B active in DeepSeek-V3; grouped-query q/o projections are wider than MLA's low-rank
    assert get_model("deepseek-v3-like").active_params / 1e9 == pytest.approx(37, rel=0.15)


def test_spec_rejects_bad_sizes_with_the_argument_named():
    with pytest.raises(ValueError, match="kv_heads=3"):
        TransformerSpec(layers=2, dim=64, heads=4, kv_heads=3, ffn=128, vocab=10)
    with pytest.raises(ValueError, match="mlp='relu'"):
        TransformerSpec(layers=2, dim=64, heads=4, ffn=128, vocab=10, mlp="relu")
    with pytest.raises(ValueError, match="top_k"):
        TransformerSpec(layers=2, dim=64, heads=4, ffn=128, vocab=10, experts=4, top_k=5,
                        expert_ffn=8)
    with pytest.raises(ValueError, match="Unknown model preset 'llama9'"):
        get_model("llama9")


# -- Korthikanti et al. (2022), Table 2 ---------------------------------------------------
@pytest.mark.parametrize("t", [1, 2, 8])
def test_gpt_block_activations_are_korthikanti_s_formulas(t):
    spec = get_model("gpt-18b")
    s, b, h, a = 2048, 2, spec.dim, spec.heads
    sbh = s * b * h
    got = lambda sp, remat: block_activation_bytes(  # noqa: E731
        spec, moe=False, tokens=s * b, seq_len=s, tp=t, sp=sp, remat=remat)
    assert got(False, "none") == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert got(True, "none") == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)))
    assert got(True, "selective") == pytest.approx(sbh * 34 / t)
    assert got(False, "selective") == pytest.approx(sbh * (10 + 24 / t))
    assert got(False, "full") == pytest.approx(2 * sbh)
    assert got(True, "full") == pytest.approx(2 * sbh / t)


def test_flash_attention_and_gqa_shrink_the_saved_activations():
    gpt = get_model("gpt-7.5b")
    fused = TransformerSpec(layers=36, dim=4096, heads=32, ffn=16384, vocab=51200,
                            mlp="gelu", dropout=True, flash_attention=True)
    gqa = TransformerSpec(layers=36, dim=4096, heads=32, kv_heads=8, ffn=16384, vocab=51200,
                          mlp="gelu", dropout=True, flash_attention=True)
    kw = dict(moe=False, tokens=2048, seq_len=2048, tp=1, sp=False, remat="none")
    full, flash, grouped = (block_activation_bytes(x, **kw) for x in (gpt, fused, gqa))
    assert flash < full / 3 and grouped < flash
    # grouped-query attention saves k and v at a quarter of the width: 2 x 2 x 3/4 x s h
    assert flash - grouped == pytest.approx(2 * 2 * 0.75 * 2048 * 4096)


@pytest.mark.parametrize("schedule, p, m", [("1f1b", 4, 8), ("gpipe", 4, 6),
                                            ("interleaved_1f1b", 4, 8), ("zb_h1", 4, 8),
                                            ("zb_v", 4, 8), ("1f1b", 8, 3)])
def test_in_flight_activations_are_the_timetable_s(schedule, p, m):
    lay = Layout(pp=p, microbatches=m, schedule=schedule)
    tt = get_schedule(schedule, p, m, lay.chunks)
    assert in_flight_chunks(lay) == max(peak_in_flight(tt))


@pytest.mark.parametrize("p, v", [(4, 2), (8, 2), (8, 4)])
def test_interleaving_costs_korthikanti_s_first_stage_factor(p, v):
    lay = Layout(pp=p, microbatches=4 * p, schedule="interleaved_1f1b", chunks=v)
    layers = 8 * p * v
    held = in_flight_chunks(lay) * layers / (p * v)       # blocks' activations on rank 0
    assert held == pytest.approx(layers * (1 + (p - 1) / (p * v)))


def _job(**kw):
    base = dict(model=get_model("gpt-7.5b"), devices=64, hardware="a100-80gb", seq_len=2048,
                global_batch=64)
    return Job(**{**base, **kw})


@pytest.mark.parametrize("zero, per_param", [(0, 18), (1, 6 + 12 / 8), (2, 2 + 16 / 8),
                                             (3, 18 / 8)])
def test_model_state_bytes_per_zero_stage(zero, per_param):
    job = _job(devices=8, global_batch=8)
    lay = Layout(dp_shard=8, zero=zero, microbatches=1) if zero else Layout(
        dp_replicate=8, microbatches=1)
    mem = memory(job, lay)
    state = mem.params + mem.grads + mem.optimizer
    assert state == pytest.approx(job.model.params * per_param, rel=1e-9)


def test_pipeline_and_tensor_parallelism_split_the_parameters():
    job = _job()
    one = memory(job, Layout(dp_replicate=64))
    split = memory(job, Layout(dp_replicate=4, tp=4, pp=4, microbatches=16))
    assert split.params == pytest.approx(one.params / 16, rel=0.1)  # the ends differ a bit


def test_hardware_round_trips_through_toml(tmp_path):
    hw = get_hardware("h100-80gb").replace(name="mine", devices_per_node=4, op_overhead=2e-6)
    path = save_hardware(hw, tmp_path / "mine.toml")
    assert load_hardware(path) == hw
    assert get_hardware(str(path)).devices_per_node == 4
    with pytest.raises(ValueError, match="op_overhead"):
        hw.replace(op_overhead=-1.0)
    (tmp_path / "bad.toml").write_text('name = "x"\nhbm_bytes = 1e9\n')
    with pytest.raises(ValueError, match="bad.toml"):
        load_hardware(tmp_path / "bad.toml")


def test_an_moe_block_s_experts_are_counted_on_their_dispatch_buffer_s_rows():
    # jaxpg's moe runs the experts on a buffer of ep * tokens * min(top_k, E / ep) rows:
    # each row past the routed tokens * top_k keeps the experts' input (dim) and hidden
    # layer (two ffn-wide tensors for GeLU) for the backward
    from jaxpg.plan.memory import block_bytes, microbatch_size

    spec = TransformerSpec(layers=2, dim=128, heads=8, ffn=512, vocab=512, mlp="gelu",
                           experts=8, top_k=2, expert_ffn=256, flash_attention=False)
    job = Job(model=spec, devices=8, hardware="h100-80gb", seq_len=128, global_batch=16,
              dtype="fp32", param_dtype="fp32")
    for ep, factor in [(1, 2), (2, 4), (4, 8), (8, 8)]:
        layout = Layout(dp_shard=8, ep=ep, zero=1)
        tokens = microbatch_size(job, layout) * job.seq_len
        padded = (factor - spec.top_k) * tokens
        extra = (block_bytes(job, layout, "none", moe=True)
                 - block_bytes(job, layout, "none", moe=True, buffers=False))
        assert extra == pytest.approx(padded * (2 * spec.expert_ffn + spec.dim) * 4), ep
    small, large = (memory(job, Layout(dp_shard=8, ep=ep, zero=1)) for ep in (1, 4))
    assert large.activations > small.activations


def test_fused_experts_keep_their_pre_activations_only_and_skip_the_buffers_hidden_passes():
    # with the experts' MLP one tiled loop (Hardware.fused_expert_mlp, XLA:CPU's), each
    # buffer row keeps one ffn-wide tensor (the pre-activations), not GeLU's two, and the
    # buffer's unused rows pass through the hidden layer once (the zero fill), not four times
    from jaxpg.plan.memory import block_bytes, microbatch_size
    from jaxpg.plan.step_time import moe_buffer_bytes

    spec = TransformerSpec(layers=2, dim=128, heads=8, ffn=512, vocab=512, mlp="gelu",
                           experts=8, top_k=2, expert_ffn=256, flash_attention=False)
    separate = get_hardware("h100-80gb")
    fused = separate.replace(fused_expert_mlp=True)
    jobs = [Job(model=spec, devices=8, hardware=hw, seq_len=128, global_batch=16,
                dtype="fp32", param_dtype="fp32") for hw in (separate, fused)]
    layout = Layout(dp_shard=8, ep=4, zero=1)
    tokens = microbatch_size(jobs[0], layout) * jobs[0].seq_len
    rows = 8 * tokens  # ep * tokens * min(top_k, E / ep)
    kept = [block_bytes(job, layout, "none", moe=True) for job in jobs]
    assert kept[0] - kept[1] == pytest.approx(rows * spec.expert_ffn * 4)
    padded = rows - tokens * spec.top_k
    moved = [moe_buffer_bytes(job, layout, tokens) for job in jobs]
    assert moved[0] - moved[1] == pytest.approx(3 * padded * spec.expert_ffn * 4)


@pytest.mark.parametrize("ep, tiles", [(1, 11), (2, 7), (4, 5), (8, 4)])
def test_the_experts_multiply_whole_tiles_each_expert_starting_its_own(ep, tiles):
    # 512 routed rows (256 tokens, top-2) fill 4 tiles of 128; each of the E / ep local
    # experts but the first starts a partial tile more, as the tiled loop's work items
    # where a group's edge falls inside a tile (routing's case; the model's upper bound)
    from jaxpg.expert_parallel.grouped_matmul import TILE_ROWS, _work_items
    from jaxpg.plan.step_time import EXPERT_TILE_ROWS, expert_tile_rows

    assert EXPERT_TILE_ROWS == TILE_ROWS
    spec = TransformerSpec(layers=2, dim=128, heads=8, ffn=512, vocab=512, mlp="gelu",
                           experts=8, top_k=2, expert_ffn=256)
    job = Job(model=spec, devices=8, hardware="h100-80gb", seq_len=128, global_batch=16,
              dtype="fp32", param_dtype="fp32")
    rows = expert_tile_rows(job, Layout(dp_shard=8, ep=ep, zero=1), 256)
    assert rows == tiles * EXPERT_TILE_ROWS
    import jax.numpy as jnp  # the loop's own count, for groups whose edges miss the tiles'

    local = spec.experts // ep
    sizes = [512 // local] * local
    if local > 1:  # every boundary 5 rows past a multiple of 64, as routing leaves them
        sizes[0], sizes[-1] = sizes[0] + 5, sizes[-1] - 5
    count = _work_items(jnp.asarray(sizes, jnp.int32), 512 // TILE_ROWS)[0]
    assert int(count) == tiles
