"""The calibration on this machine, without timing anything against a bound.

A small calibration of the ``local`` profile (8 simulated CPU devices) must give a usable
profile (every rate positive and finite, the devices counted, no overlap on CPU) under which
the planner ranks data parallelism without recomputation above recomputation and
tensor parallelism, as its model must for any positive rates; a link calibrated on 4
devices must fit a positive alpha-beta model whose predicted all-reduce grows with its size.
How well the calibrated predictions match measured steps is a measurement, so it lives in
``python -m bench planner`` (docs/planner.md), not here: a timed bound in a test fails on a
slower or busier machine.
"""

from __future__ import annotations

import pytest

from jaxpg.plan import Job, Layout, TransformerSpec, evaluate
from jaxpg.plan.calibrate import calibrate

pytestmark = pytest.mark.cpu_only

GPT = TransformerSpec(layers=1, dim=128, heads=8, ffn=512, vocab=256, mlp="gelu",
                      flash_attention=False, tied_embeddings=True)


def test_a_calibrated_profile_ranks_recomputation_and_tp_below_plain_data_parallelism():
    import math

    hw = calibrate(dtype="fp32", repeats=1, matmul_size=128, stream_mib=2)
    assert hw.overlap is False and hw.devices_per_node == 8
    rates = {"flops": hw.flops["fp32"], "hbm_bandwidth": hw.hbm_bandwidth,
             "link bandwidth": hw.intra.bandwidth, "link latency": hw.intra.latency}
    assert all(math.isfinite(v) and v > 0 for v in rates.values()), rates
    job = Job(model=GPT, devices=8, hardware=hw, seq_len=64, global_batch=16, dtype="fp32",
              param_dtype="fp32")
    plain, remat, tp = (evaluate(lay, job).step_s for lay in (
        Layout(dp_replicate=8), Layout(dp_replicate=8, remat="full"),
        Layout(tp=8, remat="full")))
    # recomputation's extra forward; tensor parallelism's narrow matmuls and all-reduces
    assert plain < min(remat, tp), (plain, remat, tp)


def test_a_calibrated_link_is_a_positive_alpha_beta_model():
    import jax

    from jaxpg.plan.calibrate import calibrate_link
    from jaxpg.plan.links import collective_time

    link = calibrate_link(devices=jax.devices()[:4], repeats=1)
    assert link.bandwidth > 0 and link.latency > 0
    times = [collective_time("all_reduce", n, 4, link, 1.0) for n in (2**10, 2**20, 2**24)]
    assert times[0] < times[1] < times[2], times


def test_a_link_needs_two_devices():
    import jax

    from jaxpg.plan.calibrate import calibrate_link

    with pytest.raises(ValueError, match="1 device"):
        calibrate_link(devices=jax.devices()[:1])
