"""One calibrated ranking check on this machine: predicted against measured step order.

A small calibration of the ``local`` profile (8 simulated CPU devices), then three layouts of
a small GPT whose predicted step times are far apart (tensor parallelism over narrow
matmuls and CPU collectives costs more the wider it is), each measured by a real step
(``jaxpg.plan.trial``). The full comparison, over 12 layouts, is ``python -m bench planner``.
"""

from __future__ import annotations

import pytest

from jaxpg.plan import Job, Layout, TransformerSpec, evaluate
from jaxpg.plan.calibrate import calibrate
from jaxpg.plan.trial import trial_step

pytestmark = pytest.mark.cpu_only

GPT = TransformerSpec(layers=1, dim=128, heads=8, ffn=512, vocab=256, mlp="gelu",
                      flash_attention=False, tied_embeddings=True)


def test_calibrated_prediction_ranks_measured_steps():
    hw = calibrate(dtype="fp32", repeats=2, matmul_size=128, stream_mib=2)
    assert hw.overlap is False and hw.matmul_half_width > 0 and hw.devices_per_node == 8
    job = Job(model=GPT, devices=8, hardware=hw, seq_len=64, global_batch=16, dtype="fp32",
              param_dtype="fp32")
    layouts = [Layout(dp_replicate=8), Layout(dp_replicate=2, tp=4), Layout(tp=8)]
    predicted = [evaluate(lay, job).step_s for lay in layouts]
    assert predicted[0] * 1.1 < predicted[1] and predicted[1] * 1.1 < predicted[2], predicted
    measured = [trial_step(job, lay, steps=2) for lay in layouts]
    # the predicted fastest is the measured fastest and the predicted slowest the slowest
    assert measured[0] < min(measured[1:]) and measured[2] > max(measured[:2]), measured
