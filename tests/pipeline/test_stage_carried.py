"""Integer and bool side inputs between PipelineStage stages: what a stage may return, and
a stage's programs taking gradients in its float inputs only (one process; the 2-process
schedules are in tests/multiprocess/test_pipeline_stage.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpg.pipeline.stage.carried import StageOutputError, check_stage_output, grad_leaves
from jaxpg.pipeline.stage.programs import plain_programs


def _s(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_an_array_or_a_tuple_of_float_int_and_bool_arrays_travels():
    check_stage_output((_s((2, 4), jnp.float32), _s((2, 4), jnp.int32), _s((2, 4), jnp.bool_)),
                       "stage 0", travels=True)
    check_stage_output(_s((2, 4), jnp.bfloat16), "stage 0", travels=True)
    check_stage_output(_s((2,), jnp.int32), "stage 1", travels=False)  # only to the loss
    assert [a.dtype for a in grad_leaves((_s((2,), jnp.int32), _s((2,), jnp.float32)))] == [
        jnp.float32]


@pytest.mark.parametrize("out, words", [
    ({"h": _s((2, 4), jnp.float32)}, "a dict with keys ['h'], not an array or a tuple"),
    (None, "NoneType None, not an array or a tuple of arrays"),
    ("h", "str 'h', not an array or a tuple of arrays"),
    ((_s((2, 4), jnp.float32), _s((), jnp.int32)), "with a scalar"),
    ((_s((2, 4), jnp.float32), _s((2,), jnp.complex64)), "with a complex64 array"),
    ((_s((2, 4), jnp.int32),), "no floating-point array"),
])
def test_other_outputs_are_named_with_the_fix(out, words):
    with pytest.raises(StageOutputError, match="stage 0 \\(M\\) returns") as err:
        check_stage_output(out, "stage 0 (M)", travels=True)
    assert words in str(err.value), str(err.value)
    assert isinstance(err.value, TypeError)


class _Shift(nnx.Module):
    """``(h * w + table[pos], pos, mask)``: the ids change the result."""

    def __init__(self):
        self.w = nnx.Param(jnp.linspace(0.5, 1.5, 4))
        self.table = nnx.Param(jnp.arange(24.0).reshape(6, 4) / 10)

    def __call__(self, h, pos, mask):
        return jnp.where(mask[..., None], h * self.w + self.table[pos], 0.0), pos, mask


def test_the_programs_pull_back_float_inputs_only():
    mod = _Shift()
    gd, params, rest = nnx.split(mod, nnx.Param, ...)
    h = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 4)), jnp.float32)
    pos = jnp.array([[1, 2, 3], [5, 0, 4]], jnp.int32)
    mask = jnp.array([[True, False, True], [True, True, False]])
    progs = plain_programs(gd, None, False)
    out, vjp = progs.forward(params, rest, (h, pos, mask))
    np.testing.assert_array_equal(out[1], pos)
    np.testing.assert_array_equal(out[2], mask)
    dy = (jnp.ones_like(h) * 2,)  # the float output's cotangent only
    dx, g = progs.backward(vjp, dy, None)
    assert len(dx) == 1 and dx[0].shape == h.shape

    def ref(p, h):
        return 2 * jnp.sum(nnx.merge(gd, p, rest)(h, pos, mask)[0])

    want_p, want_h = jax.grad(ref, argnums=(0, 1))(params, h)
    np.testing.assert_allclose(dx[0], want_h, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(want_p), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


class _PosFirst(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(12, 8, rngs=rngs)
        self.pos = nnx.Embed(8, 8, rngs=rngs)
        self.fc = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, tokens, pos):
        return jnp.tanh(self.fc(self.embed(tokens) + self.pos(pos))), pos


class _PosLast(nnx.Module):
    def __init__(self, rngs):
        self.pos = nnx.Embed(8, 8, rngs=rngs)
        self.out = nnx.Linear(8, 12, rngs=rngs)

    def __call__(self, h, pos):
        return self.out(h * self.pos(pos))


def _ce(logits, labels):
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def test_fully_sharded_stages_carry_position_ids(world):
    """Two stages, each fully sharded over 4 of the 8 devices (one process), position ids
    carried from stage 0 to stage 1 and split by rows as the activations: the whole
    model's loss and gradients on the batch (the programs a schedule runs, by hand)."""
    import jaxpg
    from jaxpg.pipeline import PipelineStage
    from jaxpg.pipeline.process.stage_runner import stage_programs

    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 12, (8, 4)), jnp.int32)
    pos = jnp.asarray(rng.integers(0, 4, (8, 1)) + np.arange(4), jnp.int32)
    labels = jnp.asarray(rng.integers(0, 12, (8, 4)), jnp.int32)
    mods = [_PosFirst(nnx.Rngs(5)), _PosLast(nnx.Rngs(6))]
    graphs, params = zip(*(nnx.split(m, nnx.Param) for m in mods), strict=True)

    def loss(ps):
        return _ce(nnx.merge(graphs[1], ps[1])(*nnx.merge(graphs[0], ps[0])(tokens, pos)),
                   labels)

    want_loss, want = jax.value_and_grad(loss)(params)
    mesh = jaxpg.init_device_mesh((2, 4), ("pp", "dp_shard"))
    stages = []
    for s, module in enumerate([_PosFirst(nnx.Rngs(5)), _PosLast(nnx.Rngs(6))]):
        with jaxpg.as_rank(4 * s):
            stages.append(PipelineStage(module, s, 2, group=mesh["pp"],
                                        fsdp_group=mesh["dp_shard"]))
    progs = [stage_programs(st, _ce) for st in stages]
    ps = [st.program_params() for st in stages]
    rests = [st.placed(st.frozen_state()) for st in stages]
    out, vjp0 = progs[0].forward(ps[0], rests[0], (tokens, pos))
    np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(pos))
    got_loss, _, vjp1 = progs[1].forward_loss(ps[1], rests[1], out, labels)
    dh, g1 = progs[1].backward(vjp1, jnp.ones((), got_loss.dtype), None)
    assert len(dh) == 1  # h's gradient only, none for the ids
    _, g0 = progs[0].backward(vjp0, dh, None)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
    for g, w in ((g0, want[0]), (g1, want[1])):
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w), strict=True):
            np.testing.assert_allclose(np.asarray(jax.device_get(a)), b, rtol=0, atol=2e-6)
