"""torch's PipelineStage / schedule classes and Paddle's PipelineLayer in one process: the
argument checks, Paddle's segmentation, and the timetables the classes run. (The runs
themselves, across processes, are in tests/multiprocess/test_pipeline_stage.py.)"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from flax import nnx

from jaxpg.pipeline import (
    LayerDesc,
    PipelineStage,
    Schedule1F1B,
    ScheduleZBVZeroBubble,
    check_timetable,
    get_schedule,
    segment_layers,
)
from jaxpg.pipeline.schedule_classes import interleaved_zero_bubble


class Block(nnx.Module):
    def __init__(self, seed: int = 0):
        self.lin = nnx.Linear(4, 4, rngs=nnx.Rngs(seed))

    def __call__(self, x):
        return jnp.tanh(self.lin(x))


class Head(Block):
    pass


def test_stage_checks_its_arguments(world):
    with pytest.raises(TypeError, match="flax.nnx.Module"):
        PipelineStage(lambda x: x, 0, 8)
    with pytest.raises(ValueError, match=r"stage_index=8 must be in 0..7"):
        PipelineStage(Block(), 8, 8)
    with pytest.raises(ValueError, match=r"num_stages=12 must be a multiple of .* size 8"):
        PipelineStage(Block(), 0, 12)
    with pytest.raises(TypeError, match="group= must be None, a ProcessGroup"):
        PipelineStage(Block(), 0, 8, group="pp")
    stage = PipelineStage(Block(), 0, 8)
    assert stage.is_first and not stage.is_last and stage.grads is None
    out = stage.output_structs((jnp.zeros((2, 4)),))
    assert [(o.shape, o.dtype) for o in out] == [((2, 4), jnp.float32)]


def test_stage_checks_its_data_parallel_group(world):
    import jaxpg

    mesh = jaxpg.init_device_mesh((2, 4), ("dp", "pp"))
    with pytest.raises(ValueError, match=r"shares ranks \[0, 1, 2, 3\] with the pipeline group"):
        PipelineStage(Block(), 0, 4, group=mesh["pp"], data_parallel_group=mesh["pp"])
    with pytest.raises(ValueError, match=r"does not hold this process's rank 0"):
        PipelineStage(Block(), 0, 4, group=mesh["pp"],
                      data_parallel_group=jaxpg.new_group([4, 5]))
    with pytest.raises(TypeError, match=r"data_parallel_group"):
        PipelineStage(Block(), 0, 4, group=mesh["pp"], data_parallel_group="dp")
    stage = PipelineStage(Block(), 0, 4, group=mesh["pp"], data_parallel_group=mesh["dp"])
    assert list(stage.dp_group.ranks) == [0, 4]


def test_schedules_check_placement_and_counts(world):
    stage = PipelineStage(Block(), 0, 8)
    with pytest.raises(ValueError, match=r"n_microbatches=0 must be an int >= 1"):
        Schedule1F1B(stage, 0, loss_fn=jnp.mean)
    with pytest.raises(TypeError, match="takes one PipelineStage"):
        Schedule1F1B([stage], 4, loss_fn=jnp.mean)
    wrong = PipelineStage(Block(), 3, 8)  # this process is pipeline rank 0
    with pytest.raises(ValueError, match=r"runs stages \[0\] on pipeline rank 0 .* passed "
                                         r"stages \[3\]"):
        Schedule1F1B(wrong, 4, loss_fn=jnp.mean)
    v_stages = [PipelineStage(Block(), s, 16) for s in (0, 1)]  # a V wants 0 and 15
    with pytest.raises(ValueError, match=r"runs stages \[0, 15\] on pipeline rank 0"):
        ScheduleZBVZeroBubble(v_stages, 16, loss_fn=jnp.mean)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8)])
def test_interleaved_zero_bubble_timetable(p, m):
    """Every F, B and W once, dependencies kept, and the interleaved order's F/B ticks."""
    tt = interleaved_zero_bubble(p, m, 2)
    check_timetable(tt)
    assert tt.split_backward and tt.num_chunks == 2
    base = get_schedule("interleaved_1f1b", p, m, 2)
    for r in range(p):
        got = [a for _, a in tt.actions_of(r)]
        assert [a for a in got if a.kind != "W"] == [a for _, a in base.actions_of(r)]
        for i, a in enumerate(got):  # each W right after its B
            if a.kind == "B":
                assert got[i + 1] == a._replace(kind="W")


def test_paddle_segmentation():
    layers = [LayerDesc(Block, 0)] + [LayerDesc(Block, i) for i in range(1, 5)] + [
        jnp.tanh, LayerDesc(Head, 5)]
    assert segment_layers(layers, 2, "uniform") == [0, 3, 7]
    assert segment_layers(layers, 3, "uniform") == [0, 2, 4, 7]
    # "layer:Head" matches one layer; "layer:^Block$" the five blocks
    with pytest.raises(ValueError, match=r"matches 1 layers, which do not divide into "
                                         r"num_stages=2"):
        segment_layers(layers, 2, "layer:Head")
    assert segment_layers(layers[1:], 2, "layer:^Block$") == [0, 2, 6]
    with pytest.raises(ValueError, match="must be 'uniform' or 'layer:"):
        segment_layers(layers, 2, "by_size")
    with pytest.raises(TypeError, match="nnx.Module class"):
        LayerDesc(jnp.tanh)
