"""DP x PP through HybridCommunicateGroup, with DDP's bucketed reducer over 'dp'."""

import pytest
from test_executor import assert_close, block, embed, head_loss, make_batch, make_params, reference

import jaxpg
from jaxpg.pipeline import pipeline_value_and_grad
from jaxpg.pipeline.dp_grad_reducer import bucketed_grad_reducer


@pytest.mark.parametrize("cap_mb", [1e-4, 25])  # many small buckets, and one bucket
def test_hcg_dp2_pp4_with_bucketed_reducer_matches_reference(world, cap_mb):
    hcg = jaxpg.HybridCommunicateGroup(dp_degree=2, pp_degree=4)
    params = make_params(4)
    reducer = bucketed_grad_reducer(params, hcg.get_pipe_parallel_world_size(),
                                    bucket_cap_mb=cap_mb, first_bucket_mb=cap_mb)
    assert (len(reducer.plan.buckets) == 1) == (cap_mb == 25)
    x, t = make_batch(16)
    loss, grads = pipeline_value_and_grad(
        block, head_loss, params, x, t, mesh=hcg, schedule="1f1b", num_microbatches=4,
        first_fn=embed, grad_reducer=reducer,
    )
    want_loss, want_grads = reference(params, x, t)
    assert_close(loss, want_loss)
    assert_close(grads, want_grads)


def test_hcg_with_a_model_parallel_axis_runs_over_dp_x_pp(world):
    hcg = jaxpg.HybridCommunicateGroup(dp_degree=2, pp_degree=2, mp_degree=2)
    params = make_params(2)
    x, t = make_batch(8)
    # the 'mp' dimension is left to the model: the pipeline still runs over dp x pp
    loss, grads = pipeline_value_and_grad(
        block, head_loss, params, x, t, mesh=hcg, schedule="gpipe", num_microbatches=2,
        first_fn=embed,
    )
    want_loss, want_grads = reference(params, x, t)
    assert_close(loss, want_loss)
    assert_close(grads, want_grads)


def test_a_dp_axis_the_mesh_lacks_is_named_with_the_fix(world):
    # ParallelDims names its data-parallel axis dp_replicate: the default "dp" is not there
    dims = jaxpg.ParallelDims(dp_replicate=2, pp=4)
    params = make_params(4)
    reducer = bucketed_grad_reducer(params, 4)
    x, t = make_batch(16)
    with pytest.raises(ValueError, match=r"dp_axis='dp' is not an axis .*dims\.axis"):
        pipeline_value_and_grad(block, head_loss, params, x, t, mesh=dims, schedule="1f1b",
                                num_microbatches=4, first_fn=embed, grad_reducer=reducer)
