"""Preflight: each configuration error named, with its fix, before anything runs."""

from __future__ import annotations

import pytest

from jaxpg.plan import Job, Layout, LayoutError, check, get_model, problems


def _job(model="llama3-8b", devices=64, **kw):
    base = dict(model=get_model(model), devices=devices, hardware="h100-80gb", seq_len=8192,
                global_batch=128)
    return Job(**{**base, **kw})


def _names(layout, job):
    return [p.name for p in problems(layout, job)]


GOOD = dict(dp_shard=8, tp=8, microbatches=16, remat="full", zero=3)


def test_a_good_layout_has_no_problems():
    assert problems(Layout(**GOOD), _job()) == []
    check(Layout(**GOOD), _job())  # does not raise


def test_degrees_against_devices_names_the_dp_shard_that_fits():
    (p,) = problems(Layout(**{**GOOD, "dp_shard": 4}), _job())
    assert p.name == "devices" and "32" in p.message and "64 devices" in p.message
    assert "dp_shard=8" in p.fix


@pytest.mark.parametrize("tp", [3, 16])
def test_tp_against_heads_and_kv_heads(tp):
    job = _job(devices=8 * tp)
    found = problems(Layout(dp_shard=8, tp=tp, microbatches=16, remat="full", zero=3), job)
    assert [p.name for p in found] == ["tp"]
    assert "heads=32" in found[0].message and "kv_heads=8" in found[0].message
    assert "1, 2, 4, 8" in found[0].fix


def test_cp_against_the_sequence():
    job = _job(seq_len=8190)
    found = problems(Layout(dp_shard=4, cp=2, tp=8, microbatches=32, remat="full", zero=3), job)
    assert [p.name for p in found] == ["cp"]
    assert "2 x cp = 4" in found[0].message and "multiple of 4" in found[0].fix


def test_fewer_microbatches_than_stages():
    lay = Layout(dp_shard=2, tp=8, pp=4, microbatches=2, remat="full")
    found = problems(lay, _job())
    assert found[0].name == "microbatches" and "fewer than pp=4" in found[0].message
    assert "microbatches >= 4" in found[0].fix


def test_interleaving_needs_a_multiple_of_the_stages():
    lay = Layout(dp_shard=2, tp=8, pp=4, microbatches=6, schedule="interleaved_1f1b")
    found = problems(lay, _job(global_batch=96))
    assert [p.name for p in found] == ["microbatches"]
    assert "microbatches=4 or 8" in found[0].fix


def test_stages_against_layers():
    lay = Layout(dp_replicate=1, tp=1, pp=64, microbatches=128)
    found = [p for p in problems(lay, _job()) if p.name == "pp"]
    assert "exceeds layers=32" in found[0].message


def test_batch_divisibility_lists_the_microbatches_that_divide():
    found = problems(Layout(**{**GOOD, "microbatches": 5}), _job())
    assert [p.name for p in found] == ["batch"]
    assert "global_batch=128" in found[0].message and "1, 2, 4, 8, 16" in found[0].fix


def test_experts_against_ep():
    job = _job("qwen3-30b-a3b", devices=64, seq_len=4096, global_batch=256)
    lay = Layout(dp_shard=64, ep=3, microbatches=4, remat="full", zero=3)
    found = problems(lay, job)
    assert {p.name for p in found} == {"ep"}
    assert any("experts=128" in p.message for p in found)
    assert any("dp_shard x cp = 64" in p.message for p in found)
    dense = problems(Layout(dp_shard=64, ep=2, microbatches=4, remat="full", zero=3),
                     _job(global_batch=256))
    assert [p.name for p in dense] == ["ep"] and "dense model" in dense[0].message


def test_memory_over_budget_suggests_what_lowers_it():
    lay = Layout(dp_replicate=8, tp=8, microbatches=1, remat="none")
    found = problems(lay, _job())
    assert [p.name for p in found] == ["memory"]
    assert "exceeds the budget 72.0 GiB" in found[0].message
    assert "remat=full" in found[0].fix and "zero=3" not in found[0].fix  # dp_shard is 1


def test_check_raises_one_error_naming_every_problem():
    lay = Layout(dp_shard=3, tp=3, microbatches=5)
    with pytest.raises(LayoutError) as info:
        check(lay, _job())
    names = [p.name for p in info.value.problems]
    assert names[:2] == ["devices", "tp"] and "batch" in names
    assert "[tp]" in str(info.value) and "Fix:" in str(info.value)
