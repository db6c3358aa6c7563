"""The planner against published runs: Megatron-LM's Table 1 (A100 80GB, sequence 2048)."""

from __future__ import annotations

import pytest

from jaxpg.plan import Job, Layout, evaluate, get_model
from jaxpg.plan.published import MEGATRON_TABLE1, megatron_tokens_per_s


@pytest.mark.parametrize("run", MEGATRON_TABLE1, ids=[r.model for r in MEGATRON_TABLE1])
def test_megatron_table1_throughput_within_25_percent(run):
    spec = get_model(run.model)
    job = Job(model=spec, devices=run.gpus, hardware="a100-80gb", seq_len=2048,
              global_batch=run.batch)
    # Megatron-LM (2021): no sequence parallelism, DDP over dp, one sequence per microbatch
    lay = Layout(dp_replicate=run.dp, tp=run.tp, pp=run.pp, microbatches=run.batch // run.dp,
                 remat="full", sp=False)
    est = evaluate(lay, job)
    assert est.fits, est.summary()
    published = megatron_tokens_per_s(run, spec)
    assert est.tokens_per_s_per_device == pytest.approx(published, rel=0.25)


@pytest.mark.parametrize("run", MEGATRON_TABLE1, ids=[r.model for r in MEGATRON_TABLE1])
def test_megatron_rows_agree_with_the_tables_own_columns(run):
    """Each row's preset has the table's parameter count, and its per-GPU teraFLOP/s times
    its GPUs is the table's aggregate petaFLOP/s (a mistyped figure fails one of them)."""
    spec = get_model(run.model)
    # the table prints billions to one decimal and counts the position embeddings too
    assert spec.params / 1e9 == pytest.approx(run.params_billion, rel=0.002, abs=0.06)
    assert run.tflops_per_gpu * run.gpus / 1e3 == pytest.approx(run.aggregate_pflops, rel=0.01)
    assert run.gpus % (run.tp * run.pp) == 0 and run.batch % run.dp == 0
