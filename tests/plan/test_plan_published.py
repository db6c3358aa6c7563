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
