"""One calibrated check on this machine: predicted against measured steps, order and size.

A small calibration of the ``local`` profile (8 simulated CPU devices, timed by the
process's CPU time), then two layouts of a small GPT, each measured by a real step
(``jaxpg.plan.trial``, its CPU seconds over the devices): the predicted pick (data
parallelism without recomputation) must be the measured fastest, and each prediction must be
within a factor 2.5 of its measurement (a profile timed by wall clock, with eight devices on
two cores, predicts several times the CPU seconds). The full comparison, over 12 layouts, is
``python -m bench planner`` (docs/planner.md).
"""

from __future__ import annotations

import pytest

from jaxpg.plan import Job, Layout, TransformerSpec, evaluate
from jaxpg.plan.calibrate import calibrate
from jaxpg.plan.trial import trial_times

pytestmark = pytest.mark.cpu_only

GPT = TransformerSpec(layers=1, dim=128, heads=8, ffn=512, vocab=256, mlp="gelu",
                      flash_attention=False, tied_embeddings=True)


def test_calibrated_prediction_ranks_and_sizes_measured_steps():
    hw = calibrate(dtype="fp32", repeats=3, matmul_size=128, stream_mib=2)
    assert hw.overlap is False and hw.devices_per_node == 8
    job = Job(model=GPT, devices=8, hardware=hw, seq_len=64, global_batch=16, dtype="fp32",
              param_dtype="fp32")
    layouts = [Layout(dp_replicate=8), Layout(dp_replicate=8, remat="full")]
    predicted = [evaluate(lay, job).step_s for lay in layouts]
    # recomputation's extra forward; tensor parallelism's narrow matmuls and all-reduces
    assert predicted[0] < min(predicted[1], evaluate(Layout(tp=8, remat="full"), job).step_s)
    # one device's CPU seconds: the fastest step's, all devices' work over their number.
    # The pick within 10% of the best measured (the planner's goal): the two are about 15%
    # apart, which a loaded machine can narrow, so a failed round is measured again (up to
    # three rounds, each layout's fastest step kept)
    measured = [float("inf")] * len(layouts)
    for _ in range(3):
        measured = [min(m, trial_times(job, lay, steps=3).seconds("cpu", "min") / job.devices)
                    for m, lay in zip(measured, layouts)]
        if measured[0] <= 1.1 * min(measured):
            break
    assert measured[0] <= 1.1 * min(measured), measured
    for p, m in zip(predicted, measured):
        assert 1 / 2.5 < p / m < 2.5, (predicted, measured)
