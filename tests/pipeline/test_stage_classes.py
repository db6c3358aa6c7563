"""torch's PipelineStage / schedule classes and Paddle's PipelineLayer in one process: the
argument checks, Paddle's segmentation, and the timetables the classes run. (The runs
themselves, across processes, are in tests/multiprocess/test_pipeline_stage.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpg.pipeline import (
    LayerDesc,
    PipelineLayer,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
    check_timetable,
    get_schedule,
)
from jaxpg.pipeline.paddle_api import segment_layers
from jaxpg.pipeline.schedule.builders import interleaved_zero_bubble


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


class Mlp(nnx.Module):
    def __init__(self, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.norm = nnx.LayerNorm(4, rngs=rngs)
        self.up = nnx.Linear(4, 8, rngs=rngs)
        self.down = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(self.norm(x))))


def _tp_mlp(tp_mesh):
    from jaxpg.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(Mlp(), tp_mesh, {"up": ColwiseParallel(),
                                               "down": RowwiseParallel()})


def test_stage_checks_its_tensor_parallel_group(world):
    import jaxpg

    mesh = jaxpg.init_device_mesh((4, 2), ("pp", "tp"))  # this process acts as rank 0
    with pytest.raises(ValueError, match=r"tensor_parallel_group=ProcessGroup.* \(ranks \[4, "
                                         r"5\]\) does not hold this process's rank 0"):
        PipelineStage(_tp_mlp(mesh["tp"]), 0, 4, group=mesh["pp"],
                      tensor_parallel_group=jaxpg.new_group([4, 5]))
    with pytest.raises(ValueError, match=r"tensor_parallel_group=DeviceMesh\(\[0, 2, 4, 6\].* "
                                         r"shares ranks \[0, 2, 4, 6\] with the pipeline group"):
        PipelineStage(_tp_mlp(mesh["tp"]), 0, 4, group=mesh["pp"],
                      tensor_parallel_group=mesh["pp"])
    with pytest.raises(ValueError, match=r"array 'down.bias' is laid out as SingleDevice.* not "
                                         r"on the group's mesh \{'pp': 4, 'tp': 2\}.*"
                                         r"parallelize_module\(module, mesh\['tp'\], plan\)"):
        PipelineStage(Mlp(), 0, 4, group=mesh["pp"], tensor_parallel_group=mesh["tp"])
    other = jaxpg.new_group([0, 1])  # the same ranks, but not the mesh the module is on
    with pytest.raises(ValueError, match=r"tensor_parallel_group=ProcessGroup.*: the module's "
                                         r"array 'down.bias' is laid out .* not on the group's"):
        PipelineStage(_tp_mlp(mesh["tp"]), 0, 4, group=mesh["pp"], tensor_parallel_group=other)
    with pytest.raises(TypeError, match=r"tensor_parallel_group"):
        PipelineStage(_tp_mlp(mesh["tp"]), 0, 4, group=mesh["pp"], tensor_parallel_group="tp")
    mesh3 = jaxpg.init_device_mesh((2, 2, 2), ("dp", "pp", "tp"))
    with pytest.raises(ValueError, match=r"shares ranks \[0, 4\] with the data-parallel group"):
        PipelineStage(_tp_mlp(mesh3["tp"]), 0, 2, group=mesh3["pp"],
                      data_parallel_group=mesh3["dp"], tensor_parallel_group=mesh3["dp"])
    module = _tp_mlp(mesh["tp"])
    # None: inferred from the module, as torch's DTensors (also once its arrays moved)
    for given, mod in ((mesh["tp"], module), (None, module), (None, _tp_mlp(mesh["tp"]))):
        stage = PipelineStage(mod, 0, 4, group=mesh["pp"], tensor_parallel_group=given)
        assert stage.tp_group.ranks == (0, 1) and stage.tp.mesh.shape == {"tp": 2}
        kernel = stage.params()["up"]["kernel"][...]
        assert kernel.sharding.mesh == stage.tp.mesh and kernel.sharding.spec == P(None, "tp")
    assert PipelineStage(Mlp(), 0, 4, group=mesh["pp"]).tp is None  # a plain module


@pytest.mark.parametrize("last", [False, True])
def test_tensor_parallel_stage_programs_give_the_unsharded_gradients(world, last):
    """A tp = 2 stage's SPMD programs (forward, whole and split backward) against jax.vjp of
    the unsharded module; the runs across processes are in test_pipeline_stage.py."""
    import jaxpg
    from jaxpg.pipeline.process.stage_runner import stage_programs

    mesh = jaxpg.init_device_mesh((4, 2), ("pp", "tp"))
    stage = PipelineStage(_tp_mlp(mesh["tp"]), 3 if last else 1, 4, group=mesh["pp"],
                          tensor_parallel_group=mesh["tp"])
    progs = stage_programs(stage, lambda y, t: jnp.mean((y - t) ** 2))
    p, rest = stage.placed(stage.params()), stage.placed(stage.frozen_state())
    x, t = jnp.linspace(-1, 1, 24).reshape(2, 3, 4), jnp.ones((2, 3, 4))
    graphdef, ref_params = nnx.split(Mlp(), nnx.Param)

    def ref(params, x):
        y = nnx.merge(graphdef, params)(x)
        return jnp.mean((y - t) ** 2) if last else jnp.sum(y)

    want_loss, (want_g, want_dx) = jax.value_and_grad(ref, argnums=(0, 1))(ref_params, x)
    if last:
        loss, _, vjp = progs.forward_loss(p, rest, (x,), t)
        dx, g = progs.backward(vjp, jnp.ones(()), None)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    else:
        out, vjp = progs.forward(p, rest, (x,))
        dy = (jnp.ones_like(out[0]),)
        dx, g = progs.backward_input(vjp, dy), progs.weight(vjp, dy, None)
        np.testing.assert_allclose(out[0], nnx.merge(graphdef, ref_params)(x), rtol=1e-5,
                                   atol=1e-5)
    np.testing.assert_allclose(dx[0], want_dx, rtol=1e-5, atol=1e-5)
    assert g["up"]["kernel"][...].sharding.spec == P(None, "tp")
    for got, want in zip(jax.tree.leaves(g), jax.tree.leaves(want_g), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


class Up(nnx.Module):
    def __init__(self):
        self.up = nnx.Linear(4, 8, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.up(x)


@pytest.mark.parametrize("last", [False, True])
def test_tensor_parallel_stage_output_must_be_replicated_over_tp(world, last):
    """A stage ending in ColwiseParallel() would send each tp peer its own half of the
    activations: the first forward finds it and names the fix; with
    ``output_layouts=Replicate()`` the output is the unsharded layer's."""
    import jaxpg
    from jaxpg.pipeline.process.stage_runner import stage_programs
    from jaxpg.tensor_parallel import ColwiseParallel, Replicate, parallelize_module

    mesh = jaxpg.init_device_mesh((4, 2), ("pp", "tp"))
    x = jnp.linspace(-1, 1, 24).reshape(2, 3, 4)
    want = Up()(x)
    for style, ok in ((ColwiseParallel(), False),
                      (ColwiseParallel(output_layouts=Replicate()), True)):
        stage = PipelineStage(parallelize_module(Up(), mesh["tp"], {"up": style}),
                              3 if last else 1, 4, group=mesh["pp"])
        # a loss that a sharded output would not break (as cross-entropy over a vocabulary
        # split by tp): each rank's sum over its half of the features
        progs = stage_programs(stage, lambda y, t: jnp.mean((y.sum(-1) - t) ** 2))
        p, rest = stage.placed(stage.params()), stage.placed(stage.frozen_state())

        def run(progs=progs, p=p, rest=rest):
            if last:
                return progs.forward_loss(p, rest, (x,), jnp.zeros((2, 3)))[1]
            return progs.forward(p, rest, (x,))[0]

        if ok:
            np.testing.assert_allclose(run()[0], want, rtol=1e-5, atol=1e-6)
        else:
            with pytest.raises(ValueError, match=r"(output|loss or output) of a "
                               r"tensor-parallel stage differs across its tp group \(devices "
                               r"\[0, 1\], axis 'tp'\) by up to .*ColwiseParallel\("
                               r"output_layouts=Replicate\(\)\)"):
                run()


def test_schedules_check_placement_and_counts(world):
    stage = PipelineStage(Block(), 0, 8)
    with pytest.raises(ValueError, match=r"n_microbatches=0 must be an int >= 1"):
        Schedule1F1B(stage, 0, loss_fn=jnp.mean)
    with pytest.raises(TypeError, match="takes one PipelineStage"):
        Schedule1F1B([stage], 4, loss_fn=jnp.mean)
    wrong = PipelineStage(Block(), 3, 8)  # this process is pipeline rank 0
    with pytest.raises(ValueError, match=r"runs stages \[0\] on pipeline rank 0 .* passed "
                                         r"stages \[3\]"):
        Schedule1F1B(wrong, 8, loss_fn=jnp.mean)
    v_stages = [PipelineStage(Block(), s, 16) for s in (0, 1)]  # a V wants 0 and 15
    with pytest.raises(ValueError, match=r"runs stages \[0, 15\] on pipeline rank 0"):
        ScheduleZBVZeroBubble(v_stages, 16, loss_fn=jnp.mean)


def test_schedules_refuse_fewer_microbatches_than_torch_allows(world):
    """torch's rules per class: Schedule1F1B takes n_microbatches >= its stages (torch
    raises ``Number of microbatches (4) must be greater than or equal to the number of
    stages (8)``); ScheduleGPipe and ScheduleZBVZeroBubble take any count; the interleaved
    classes name the count their timetable needs."""
    stage = PipelineStage(Block(), 0, 8)
    with pytest.raises(ValueError, match=r"Schedule1F1B n_microbatches=4 must be >= the "
                                         r"number of stages \(8\), as torch's.*Use "
                                         r"n_microbatches >= 8 .*or ScheduleGPipe"):
        Schedule1F1B(stage, 4, loss_fn=jnp.mean)
    loop = [PipelineStage(Block(), s, 16) for s in (0, 8)]
    with pytest.raises(ValueError, match=r"ScheduleInterleaved1F1B n_microbatches=3 over 16 "
                                         r"stages: .*m=3 to be a multiple of .*p=8; use m=8"):
        ScheduleInterleaved1F1B(loop, 3, loss_fn=jnp.mean)
    # past the counts, one process with 8 devices is refused (below), not the count
    for make in (lambda: Schedule1F1B(stage, 8, loss_fn=jnp.mean),
                 lambda: ScheduleGPipe(stage, 2, loss_fn=jnp.mean),
                 lambda: ScheduleZBVZeroBubble([PipelineStage(Block(), s, 16) for s in (0, 15)],
                                               3, loss_fn=jnp.mean)):
        with pytest.raises(ValueError, match="one process with several devices"):
            make()


def test_dualpipe_v_and_looped_bfs_classes_check_like_torchs(world):
    """ScheduleDualPipeV (attributes of jaxpg.pipeline, as torch's of its pipelining
    package) puts stages r and 2p - 1 - r on rank r and takes at least as many microbatches
    as stages (torch: ``DualPipeV requires at least as many microbatches as stages``);
    ScheduleLoopedBFS puts stage s on rank s % p and takes any count."""
    import jaxpg.pipeline as pipeline

    assert "ScheduleDualPipeV" not in pipeline.__all__ and len(pipeline.__all__) <= 25
    v_stages = [PipelineStage(Block(), s, 16) for s in (0, 15)]
    with pytest.raises(ValueError, match=r"ScheduleDualPipeV n_microbatches=15 over 16 stages: "
                                         r".*n_microbatches >= the number of stages \(16\), "
                                         r"as torch's does; use n_microbatches >= 16"):
        pipeline.ScheduleDualPipeV(v_stages, 15, loss_fn=jnp.mean)
    with pytest.raises(ValueError, match=r"takes exactly 2 stages per process \(a V\), got 1"):
        pipeline.ScheduleDualPipeV([PipelineStage(Block(), 0, 8)], 8, loss_fn=jnp.mean)
    with pytest.raises(ValueError, match=r"runs stages \[0, 8\] on pipeline rank 0"):
        pipeline.ScheduleLoopedBFS(v_stages, 3, loss_fn=jnp.mean)
    for make in (lambda: pipeline.ScheduleDualPipeV(v_stages, 16, loss_fn=jnp.mean),
                 lambda: pipeline.ScheduleLoopedBFS(
                     [PipelineStage(Block(), s, 16) for s in (0, 8)], 3, loss_fn=jnp.mean)):
        with pytest.raises(ValueError, match="one process with several devices"):
            make()


def _layers():
    return [LayerDesc(Block, 0), LayerDesc(Block, 1), LayerDesc(Head, 2), LayerDesc(Head, 3)]


def test_stage_classes_refuse_one_process_with_several_devices(world):
    """Made in one process of 8 devices, the schedules and PipelineLayer refuse before a
    step (they failed inside it, in JAX's make_array_from_single_device_arrays), naming
    the two layouts that work."""
    fix = (r"holds {n} ranks of the pipeline group .*one process with several devices.*"
           r"jaxpg-run --nproc-per-node {n}.*make_train_step\(stage_fn, loss_fn, optimizer, "
           r"mesh=\.\.\., param_specs=\.\.\.\)")
    with pytest.raises(ValueError, match="Schedule1F1B: this process " + fix.format(n=8)):
        Schedule1F1B(PipelineStage(Block(), 0, 8), 8, loss_fn=jnp.mean)
    with pytest.raises(ValueError, match="PipelineLayer: this process " + fix.format(n=8)):
        PipelineLayer(_layers() * 2, 8, jnp.mean)
    import jaxpg

    jaxpg.HybridCommunicateGroup(dp_degree=2, mp_degree=2, pp_degree=2)
    with pytest.raises(ValueError, match="PipelineLayer: this process " + fix.format(n=2)):
        PipelineLayer(_layers(), 2, jnp.mean)


def test_pipeline_layer_takes_the_hybrid_groups_data_parallel_group(world):
    """PipelineLayer's groups under a HybridCommunicateGroup, as Paddle's: the pipeline is
    its pp group, the data-parallel replicas its dp x sharding group (whose gradients
    train_batch averages; the runs across processes are in test_pipeline_stage.py), and
    the layouts it cannot train are refused when it is made."""
    import jaxpg
    from jaxpg.pipeline.layer_groups import layer_groups
    from jaxpg.pipeline.stage.pipeline_stage import _pipeline_group

    # this process acts as rank 0: the rank order is (dp, pp, sharding, sep, mp)
    for degrees, pp_ranks, dp_ranks in (
            (dict(dp_degree=2, mp_degree=2, pp_degree=2), (0, 2), (0, 4)),
            (dict(sharding_degree=2, mp_degree=2, pp_degree=2), (0, 4), (0, 2)),
            (dict(dp_degree=2, sharding_degree=2, pp_degree=2), (0, 2), (0, 1, 4, 5)),
            (dict(pp_degree=2, mp_degree=4), (0, 4), None)):
        hcg = jaxpg.HybridCommunicateGroup(**degrees)
        for given in (None, hcg):  # the world's latest, or passed
            pipe, dp = layer_groups(None, given, _pipeline_group)
            assert tuple(pipe.ranks) == pp_ranks, (degrees, pipe)
            assert (None if dp is None else tuple(dp.ranks)) == dp_ranks, (degrees, dp)
        pipe, _ = layer_groups(hcg.get_pipe_parallel_group(), None, _pipeline_group)
        assert tuple(pipe.ranks) == pp_ranks
    with pytest.raises(ValueError, match=r"group=.* is not the pipeline group .* of "
                                         r"HybridCommunicateGroup\(dp=1, pp=2, mp=4\); leave "
                                         r"group=None"):
        PipelineLayer(_layers(), 2, jnp.mean, group=jaxpg.new_group([0, 1]))
    jaxpg.HybridCommunicateGroup(dp_degree=2, sep_degree=2, pp_degree=2)
    with pytest.raises(ValueError, match=r"cannot train under HybridCommunicateGroup\(.*\) "
                                         r"with sep_degree=2"):
        PipelineLayer(_layers(), 2, jnp.mean)
    with pytest.raises(TypeError, match=r"hcg= must be a HybridCommunicateGroup"):
        PipelineLayer(_layers(), 2, jnp.mean, hcg=jaxpg.init_device_mesh((2, 4), ("dp", "pp")))


def test_pipeline_layer_without_a_hybrid_group_must_hold_the_world(world):
    """Without a HybridCommunicateGroup, a pipeline over part of the world would leave the
    other processes training apart: refused, naming the fix."""
    import jaxpg

    with pytest.raises(ValueError, match=r"holds 2 of the world's 8 processes, and no "
                                         r"HybridCommunicateGroup.*HybridCommunicateGroup\("
                                         r"dp_degree=2, pp_degree=2\)"):
        PipelineLayer(_layers(), 2, jnp.mean, group=jaxpg.new_group([0, 1]))


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
