"""Bad input to ``moe`` and ``MoELayer`` raises a clear error before anything runs."""

import jax
import numpy as np
import pytest

import jaxpg
from jaxpg.expert_parallel import MoELayer, moe


def _args(ep=2, tokens=4, d=8, f=16, experts=8):
    r = np.random.default_rng(0)
    return (r.normal(size=(tokens, d)).astype(np.float32),
            r.normal(size=(d, experts)).astype(np.float32),
            r.normal(size=(experts // ep, d, f)).astype(np.float32),
            r.normal(size=(experts // ep, f, d)).astype(np.float32))


def _run(group, *args, **options):
    ep = group.size()
    stacked = [np.broadcast_to(a, (ep, *a.shape)) for a in args]
    return jaxpg.spmd(lambda *a: moe(*a, group=group, **options), group=group)(*stacked)


@pytest.mark.parametrize("change,options,match", [
    (lambda x, g, a, b: (x, g[:, :7], a, b), {}, r"E=7 .*divisible by .*ep=2"),
    (lambda x, g, a, b: (x, g, a, b), {"top_k": 9}, r"top_k=9 must be between 1 and .*E=8"),
    (lambda x, g, a, b: (x, g, a, b), {"top_k": 0}, r"top_k=0"),
    (lambda x, g, a, b: (x, g[:6], a, b), {}, r"gate_w must be \(d, E\) = \(8, E\)"),
    (lambda x, g, a, b: (x, g, a[:3], b), {}, r"w1 must be \(E_local, d, f\) = \(4, 8, f\)"),
    (lambda x, g, a, b: (x, g, a, b[:, :5]), {}, r"w2 must be \(E_local, f, d\) = \(4, 16, 8\)"),
    (lambda x, g, a, b: (x[0], g, a, b), {}, r"x must be \(tokens_local, d\)"),
    (lambda x, g, a, b: (x, g, a, b), {"capacity_factor": 0.0}, r"capacity_factor=0.0"),
    (lambda x, g, a, b: (x, g, a, b), {"grouped_matmul": "megablox"},
     r"grouped_matmul='megablox' must be one of 'auto', 'xla', 'tiled', 'mosaic'"),
    (lambda x, g, a, b: (x[:3], g, a, b), {"replicated_tokens": True},
     r"replicated_tokens=True splits the 3 tokens over the ep=2 ranks"),
], ids=["E-not-divisible", "top_k-over-E", "top_k-zero", "gate-width", "w1-shape",
        "w2-shape", "x-rank", "capacity", "grouped-matmul", "replicated-tokens"])
def test_bad_arguments_raise_before_running(change, options, match):
    group = jaxpg.new_group([0, 1])
    with pytest.raises(ValueError, match=match):
        _run(group, *change(*_args()), **options)


def test_top_k_must_be_an_int():
    with pytest.raises(TypeError, match="top_k must be an int; got 1.5"):
        _run(jaxpg.new_group([0, 1]), *_args(), top_k=1.5)


def test_group_must_be_one_mesh_dimension():
    mesh = jaxpg.init_device_mesh((2, 4), ("dp", "ep"))
    with pytest.raises(ValueError, match=r"2-D DeviceMesh .*group=mesh\['ep'\]"):
        moe(*_args(), group=mesh)
    with pytest.raises(TypeError, match=r"group= takes a ProcessGroup, a 1-D DeviceMesh"):
        moe(*_args(), group="ep")
    uneven, _ = jaxpg.new_subgroups_by_enumeration([[0, 1, 2], [3, 4, 5, 6, 7]])  # not an axis
    with pytest.raises(ValueError, match="uneven subgroups.*not one dimension of a mesh"):
        MoELayer(8, 16, 6, group=uneven, rngs=None)


def test_layer_checks_its_sizes():
    group = jaxpg.new_group([0, 1, 2, 3])
    with pytest.raises(ValueError, match="num_experts=6 must be divisible by .*ep=4"):
        MoELayer(8, 16, 6, group=group)
    with pytest.raises(ValueError, match="top_k=9 must be an int between 1 and num_experts=8"):
        MoELayer(8, 16, 8, top_k=9, group=group)
    with pytest.raises(ValueError, match="MoELayer: grouped_matmul='dense' must be one of"):
        MoELayer(8, 16, 8, group=group, grouped_matmul="dense")
    with pytest.raises(TypeError, match="MoELayer: replicated_tokens must be a bool; got 1"):
        MoELayer(8, 16, 8, group=group, replicated_tokens=1)
    with pytest.raises(TypeError, match="pass rngs=nnx.Rngs"):
        MoELayer(8, 16, 8, group=group)


def test_host_call_checks_the_stacked_form():
    # From host code, a process holding both ranks passes their arguments stacked.
    group = jaxpg.new_group([0, 1])
    x, g, a, b = _args()
    with pytest.raises(ValueError, match=r"w1 must be \(E_local, d, f\) = \(4, 8, f\)"):
        moe(np.stack([x, x]), np.stack([g, g]), np.stack([a[:2], a[:2]]), np.stack([b, b]),
            group=group)
    assert jax.devices()  # the world is still usable
