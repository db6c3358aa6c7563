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


def _predicted(layouts):
    # the bench's calibration sizes: a 128-wide matmul is too short to time its FLOP/s
    # steadily (13 to 98 GFLOP/s over runs here)
    hw = calibrate(dtype="fp32", repeats=3, matmul_size=256, stream_mib=8)
    assert hw.overlap is False and hw.devices_per_node == 8
    job = Job(model=GPT, devices=8, hardware=hw, seq_len=64, global_batch=16, dtype="fp32",
              param_dtype="fp32")
    predicted = [evaluate(lay, job).step_s for lay in layouts]
    # recomputation's extra forward; tensor parallelism's narrow matmuls and all-reduces
    assert predicted[0] < min(predicted[1], evaluate(Layout(tp=8, remat="full"), job).step_s)
    return job, predicted


def test_calibrated_prediction_ranks_and_sizes_measured_steps():
    layouts = [Layout(dp_replicate=8), Layout(dp_replicate=8, remat="full")]
    job, predicted = _predicted(layouts)
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

    def within(pred):
        return all(1 / 2.5 < p / m < 2.5 for p, m in zip(pred, measured))

    # the calibration is a measurement too: one that a busy moment skewed is taken again
    if not within(predicted):
        _, predicted = _predicted(layouts)
    assert within(predicted), (predicted, measured)


def test_a_calibrated_link_predicts_an_all_reduce_of_another_size():
    # the alpha-beta fit from two sizes (4 KiB x devices and 4 MiB) and the chained small
    # collectives predicts a 1 MiB all-reduce, timed the same way (CPU seconds over the
    # devices), within a factor 2
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxpg.plan.calibrate import calibrate_link
    from jaxpg.plan.links import collective_time

    devices = jax.devices()[:4]
    link = calibrate_link(devices=devices, repeats=3)
    assert link.bandwidth > 0 and link.latency > 0
    mesh = Mesh(np.array(devices), ("d",))
    words = 2**20 // 4
    x = jax.device_put(jnp.ones((4, words), jnp.float32),
                       NamedSharding(mesh, PartitionSpec("d")))
    fn = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "d") * 0.5, mesh=mesh,
                               in_specs=PartitionSpec("d"), out_specs=PartitionSpec("d")))
    jax.block_until_ready(fn(x))
    samples = []
    for _ in range(5):
        begin = time.process_time()
        jax.block_until_ready(fn(x))
        samples.append((time.process_time() - begin) / 4)
    predicted = collective_time("all_reduce", words * 4, 4, link, 1.0)
    assert 0.5 < predicted / min(samples) < 2.0, (predicted, samples, link)


def test_a_link_needs_two_devices():
    import jax

    from jaxpg.plan.calibrate import calibrate_link

    with pytest.raises(ValueError, match="1 device"):
        calibrate_link(devices=jax.devices()[:1])
