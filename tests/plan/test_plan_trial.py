"""The trial step computes one training step, whatever the layout.

``jaxpg.plan.trial`` times a layout's step; its ZeRO-0/1 path reduces each dp rank's
accumulated gradients once, its ZeRO-2/3 path lets XLA reduce-scatter each microbatch's and
ZeRO-3 gathers each weight where it is used. From the same parameters and tokens, one step
of each layout must give the gradient of one device's step on the whole batch, read from
the Adam first moment after one step (a tenth of the gradient: linear in it, where Adam's
update would hide a gradient scaled by a constant).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxpg.plan import Job, Layout, TransformerSpec
from jaxpg.plan.hardware import get_hardware
from jaxpg.plan.trial import _build

pytestmark = pytest.mark.cpu_only

GPT = TransformerSpec(layers=1, dim=32, heads=4, ffn=64, vocab=64, mlp="gelu",
                      flash_attention=False, tied_embeddings=True)


def _one_step(layout: Layout, devices: int, batch: np.ndarray | None = None):
    """The first moment after one step, and the batch it took (``batch``: these sequences)."""
    job = Job(model=GPT, devices=devices, hardware=get_hardware("h100-80gb"), seq_len=16,
              global_batch=16, dtype="fp32", param_dtype="fp32")
    fn, (params, opt, tokens) = _build(job, layout, jax.devices()[:devices], seed=0)
    if batch is not None:  # the same 16 sequences, split into the layout's microbatches
        tokens = jax.device_put(batch.reshape(tokens.shape), tokens.sharding)
    taken = np.asarray(tokens).reshape(-1, tokens.shape[-1])
    _, (mu, _) = fn(params, opt, tokens)
    return jax.tree.map(np.asarray, mu), taken


@pytest.mark.parametrize("layout", [
    Layout(dp_replicate=8, microbatches=2, remat="selective"),  # ZeRO 0: reduced once
    Layout(dp_shard=8, zero=1, microbatches=2),
    Layout(dp_shard=4, tp=2, zero=3, microbatches=2),  # each weight gathered where used
    Layout(dp_replicate=2, tp=4, remat="full"),
], ids=str)
def test_a_layouts_step_is_one_devices_step(layout):
    want, batch = _one_step(Layout(), 1)
    got, taken = _one_step(layout, 8, batch)
    np.testing.assert_array_equal(taken, batch)
    assert len(jax.tree.leaves(got)) == len(jax.tree.leaves(want))
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)


MOE = TransformerSpec(layers=1, dim=16, heads=2, ffn=32, vocab=32, mlp="gelu",
                      flash_attention=False, tied_embeddings=True, experts=4, top_k=2,
                      expert_ffn=16)


def _moe_step(layout: Layout, devices: int, batch: np.ndarray | None = None):
    job = Job(model=MOE, devices=devices, hardware=get_hardware("h100-80gb"), seq_len=8,
              global_batch=16, dtype="fp32", param_dtype="fp32")
    fn, (params, opt, tokens) = _build(job, layout, jax.devices()[:devices], seed=0)
    if batch is not None:
        tokens = jax.device_put(batch.reshape(tokens.shape), tokens.sharding)
    taken = np.asarray(tokens).reshape(-1, tokens.shape[-1])
    _, (mu, _) = fn(params, opt, tokens)
    return jax.tree.map(np.asarray, mu), taken


def test_a_moe_layouts_step_is_one_devices_step(world):
    # two ep groups of 4 (the tokens exchanged by all_to_all within each, the experts'
    # gradients reduced over the groups), each rank accumulating two microbatches
    want, batch = _moe_step(Layout(), 1)
    got, taken = _moe_step(Layout(dp_shard=8, ep=4, zero=1, microbatches=2), 8, batch)
    np.testing.assert_array_equal(taken, batch)
    assert got["blocks"][0]["w1"].shape == (4, 16, 16)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("model,layout,message", [
    (MOE, Layout(dp_shard=4, tp=2, ep=2), "tp=1"),
    (GPT, Layout(dp_shard=8, ep=2), "no experts"),
    (MOE, Layout(dp_shard=8, ep=8), "must divide"),
], ids=["moe-tp", "dense-ep", "ep-over-experts"])
def test_trials_refuse_what_they_do_not_run(model, layout, message):
    from jaxpg.plan.trial import trial_times

    job = Job(model=model, devices=8, hardware=get_hardware("h100-80gb"), seq_len=8,
              global_batch=16, dtype="fp32", param_dtype="fp32")
    with pytest.raises(ValueError, match=message):
        trial_times(job, layout)


WIDE_MOE = TransformerSpec(layers=1, dim=16, heads=2, ffn=32, vocab=32, mlp="gelu",
                           flash_attention=False, tied_embeddings=True, experts=8, top_k=2,
                           expert_ffn=24)


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_the_planners_moe_buffers_are_the_layers(world, ep):
    # the step time prices the dispatch buffers' traffic from their rows: they must be the
    # rows of the buffers the MoE layer's program holds (its experts' hidden layer, the
    # exchange's buffers), read from the trial step's lowered program
    import re

    from jaxpg.expert_parallel.grouped_matmul import TILE_ROWS
    from jaxpg.plan.memory import microbatch_size, moe_buffer_rows

    layout = Layout(dp_shard=8, ep=ep, zero=1)
    job = Job(model=WIDE_MOE, devices=8, hardware=get_hardware("h100-80gb"), seq_len=8,
              global_batch=16, dtype="fp32", param_dtype="fp32")
    fn, args = _build(job, layout, jax.devices()[:8], seed=0)
    shapes = {tuple(map(int, m)) for m in re.findall(r"tensor<(\d+)x(\d+)xf32>",
                                                      fn.lower(*args).as_text())}
    tokens = microbatch_size(job, layout) * job.seq_len  # a device's tokens
    grouped, per_pair = moe_buffer_rows(job, layout, tokens)
    # the experts' pre-activations hold the worst case's rows, padded to whole tiles by
    # CPU's tiled MLP loop (jaxpg.expert_parallel.grouped_mlp), and nothing is larger
    tiles = -(-grouped // TILE_ROWS) * TILE_ROWS
    assert (tiles, WIDE_MOE.expert_ffn) in shapes, sorted(shapes)
    assert max(rows for rows, cols in shapes if cols == WIDE_MOE.expert_ffn) <= tiles
    assert (ep * per_pair, WIDE_MOE.dim) in shapes, sorted(shapes)
    assert per_pair < grouped // ep  # the first try is smaller than the worst case


@pytest.mark.parametrize("layout", [
    Layout(dp_replicate=8),
    Layout(dp_shard=8, zero=1),
    Layout(dp_shard=4, tp=2, zero=3, microbatches=2),
], ids=str)
def test_a_trials_compiled_memory_holds_its_state_as_the_shardings_place_it(layout):
    # XLA's arguments on device 0 are the bytes of device 0's shards of the parameters,
    # Adam moments and tokens; the new parameters and moments are written over the donated
    # ones (all aliased but the output tuple's table, a pointer a leaf); trial_times
    # reports the program trial_memory compiles
    from jaxpg.plan.trial import trial_memory, trial_times

    job = Job(model=GPT, devices=8, hardware=get_hardware("h100-80gb"), seq_len=16,
              global_batch=16, dtype="fp32", param_dtype="fp32")
    devices = jax.devices()[:8]
    _, (params, opt, tokens) = _build(job, layout, devices, seed=0)

    def on_device0(tree):
        return sum(s.data.nbytes for leaf in jax.tree.leaves(tree)
                   for s in leaf.addressable_shards if s.device == devices[0])

    state = on_device0((params, opt))
    memory = trial_memory(job, layout)
    assert memory.arguments == state + on_device0(tokens)
    assert memory.aliased == state
    assert 0 <= memory.outputs - state <= 8 * len(jax.tree.leaves((params, opt)))
    assert memory.temporaries > 0
    assert memory.peak == memory.arguments + memory.outputs - state + memory.temporaries
    assert trial_times(job, layout, steps=1).memory == memory


def test_the_profile_s_collective_count_is_the_compiled_fsdp_step_s():
    # calibrate()'s reading of the compiler (two parameters' gathers kept apart or merged)
    # against the gathers of a ZeRO-3 trial step as XLA compiles it: one per parameter
    # tensor where it keeps them apart, at most one per FSDP unit where it merges them
    import re

    from jaxpg.plan.calibrate import collectives_per_tensor
    from jaxpg.plan.trial import compile_trial

    spec = TransformerSpec(layers=2, dim=32, heads=4, ffn=64, vocab=64, mlp="gelu",
                           flash_attention=False, tied_embeddings=True)
    job = Job(model=spec, devices=8, hardware=get_hardware("h100-80gb"), seq_len=16,
              global_batch=16, dtype="fp32", param_dtype="fp32")
    text = compile_trial(job, Layout(dp_shard=8, zero=3))._fn.as_text()
    gathers = len(re.findall(r"\sall-gather(?:-start)?\(", text))
    units = spec.layers + 1
    if collectives_per_tensor(devices=jax.devices()[:8]):
        # each block's matrices (q, k, v, o and the MLP's two) and the embedding, at least
        assert gathers >= spec.layers * 6 + 1, gathers
    else:
        assert gathers <= units, gathers
    assert collectives_per_tensor(devices=jax.devices()[:1]) is False


def test_the_profile_reads_whether_the_experts_run_fused():
    # calibrate() records jaxpg's choice of the experts' grouped matmul for the backend:
    # the tiled loop (its MLP fused) on CPU, whose trial steps run it
    import jax.numpy as jnp

    from jaxpg.expert_parallel.grouped_matmul import resolve_grouped_matmul
    from jaxpg.plan.calibrate import experts_fused

    rows, experts = jnp.zeros((8, 128)), jnp.zeros((2, 128, 128))
    assert experts_fused() == (resolve_grouped_matmul("auto", rows, experts) == "tiled")
    assert experts_fused() is (jax.default_backend() == "cpu")
