"""``moe`` against the one-device reference: output, the four gradients, aux loss, counts
and drops, at ep = 2 and 4, top_k 1 and 2, dropless and with a capacity (one process, the
ranks stacked under ``jaxpg.spmd``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _moe_reference import reference_keep, reference_loss_and_grads, reference_moe

import jaxpg
from jaxpg.expert_parallel import moe

TOL = 1e-5
T, D, F, E = 6, 8, 16, 8  # tokens per rank, model width, expert width, experts


def _inputs(ep, seed=0):
    r = np.random.default_rng(seed)
    x = r.normal(size=(ep * T, D)).astype(np.float32)
    gate_w = r.normal(size=(D, E)).astype(np.float32)
    w1 = (r.normal(size=(E, D, F)) / 3).astype(np.float32)
    w2 = (r.normal(size=(E, F, D)) / 3).astype(np.float32)
    cot = r.normal(size=(ep * T, D)).astype(np.float32)
    return x, gate_w, w1, w2, cot


def _stacked(ep, x, gate_w, w1, w2, cot):
    """The ranks' arguments stacked on a leading rank dimension (the router on each)."""
    return (x.reshape(ep, T, D), np.broadcast_to(gate_w, (ep, D, E)),
            w1.reshape(ep, E // ep, D, F), w2.reshape(ep, E // ep, F, D),
            cot.reshape(ep, T, D))


def _assert_grads(grads, want_grads, ep):
    """The stacked ranks' gradients of (x, gate_w, w1, w2) against the one-device ones."""
    gx, ggate, gw1, gw2 = grads
    np.testing.assert_allclose(np.asarray(gx).reshape(ep * T, D), want_grads[0],
                               rtol=TOL, atol=TOL)
    # gate_w is one replicated parameter: its gradient is the sum of the ranks' parts.
    np.testing.assert_allclose(np.asarray(ggate).sum(0), want_grads[1], rtol=TOL, atol=TOL)
    np.testing.assert_allclose(np.asarray(gw1).reshape(E, D, F), want_grads[2],
                               rtol=TOL, atol=TOL)
    np.testing.assert_allclose(np.asarray(gw2).reshape(E, F, D), want_grads[3],
                               rtol=TOL, atol=TOL)


def _ep_loss(ep, group, **options):
    """The loss of the stacked per-rank layout: sum(y · cot) + aux loss (rank 0's copy)."""
    run = jaxpg.spmd(lambda x, g, a, b: moe(x, g, a, b, group=group, **options), group=group)

    def loss(x, gate_w, w1, w2, cot):
        y, aux = run(x, gate_w, w1, w2)
        return jnp.sum(y * cot) + aux.loss[0], (y, aux)

    return loss


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("top_k,capacity_factor,normalize",
                         [(1, None, True), (2, None, True), (1, 1.0, False), (2, 1.25, True)],
                         ids=["k1-dropless", "k2-dropless", "k1-cap1.0-gshard", "k2-cap1.25"])
def test_moe_equals_one_device_reference(ep, top_k, capacity_factor, normalize,
                                        grouped_matmul="auto"):
    x, gate_w, w1, w2, cot = _inputs(ep)
    options = dict(top_k=top_k, capacity_factor=capacity_factor, normalize_topk=normalize)
    reference_options = dict(options)
    options["grouped_matmul"] = grouped_matmul
    group = jaxpg.new_group(list(range(ep)))

    want, want_grads = reference_loss_and_grads(x, gate_w, w1, w2, cot, **reference_options)
    y_ref, aux_ref, counts_ref, dropped_ref = reference_moe(x, gate_w, w1, w2,
                                                            **reference_options)
    stacked = _stacked(ep, x, gate_w, w1, w2, cot)
    (got, (y, aux)), grads = jax.jit(jax.value_and_grad(
        _ep_loss(ep, group, **options), argnums=(0, 1, 2, 3), has_aux=True))(*stacked)
    np.testing.assert_allclose(np.asarray(y).reshape(ep * T, D), y_ref, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(np.asarray(aux.loss), np.full(ep, aux_ref), rtol=TOL)
    np.testing.assert_array_equal(np.asarray(aux.counts), np.tile(counts_ref, (ep, 1)))
    np.testing.assert_array_equal(np.asarray(aux.dropped), np.full(ep, dropped_ref))
    if capacity_factor is not None and top_k == 1:
        assert dropped_ref > 0  # the capacity case really drops
    _assert_grads(grads, want_grads, ep)


@pytest.mark.parametrize("top_k,capacity_factor", [(2, None), (1, 1.0)],
                         ids=["k2-dropless", "k1-cap1.0"])
def test_moe_with_xlas_ragged_dot_equals_the_reference(top_k, capacity_factor):
    # "auto" is the tiled loop on CPU; XLA's ragged_dot is what other GPUs and float32 take.
    test_moe_equals_one_device_reference(4, top_k, capacity_factor, True, grouped_matmul="xla")


def test_moe_from_host_code_with_stacked_ranks():
    # Outside SPMD code: this process's ranks' arguments stacked, run eagerly.
    ep = 2
    x, gate_w, w1, w2, _ = _inputs(ep, seed=1)
    y, aux = moe(x.reshape(ep, T, D), np.broadcast_to(gate_w, (ep, D, E)),
                 w1.reshape(ep, E // ep, D, F), w2.reshape(ep, E // ep, F, D),
                 group=jaxpg.new_group([0, 1]), top_k=2)
    y_ref, loss_ref, counts_ref, _ = reference_moe(x, gate_w, w1, w2, top_k=2)
    np.testing.assert_allclose(np.asarray(y).reshape(ep * T, D), y_ref, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(np.asarray(aux.loss), [loss_ref] * ep, rtol=TOL)
    np.testing.assert_array_equal(np.asarray(aux.counts)[1], counts_ref)


@pytest.mark.parametrize("ep,top_k,capacity_factor", [(4, 2, None), (2, 1, 1.0)],
                         ids=["ep4-k2-dropless", "ep2-k1-cap1.0"])
def test_replicated_tokens_follow_tensor_parallelism(ep, top_k, capacity_factor):
    """Every rank holds all the tokens (a tensor-parallel region) and takes gradients
    itself, as a tensor-parallel pipeline stage does: y, x's and the router's gradients are
    the whole one-device ones on every rank, each expert's gradient its own."""
    x, gate_w, w1, w2, cot = _inputs(ep, seed=2)
    options = dict(top_k=top_k, capacity_factor=capacity_factor)
    group = jaxpg.new_group(list(range(ep)))

    def per_rank(x, gate_w, w1, w2, cot):
        def loss(x, gate_w, w1, w2):
            y, aux = moe(x, gate_w, w1, w2, group=group, replicated_tokens=True, **options)
            return jnp.sum(y * cot) + aux.loss, (y, aux)
        return jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, gate_w, w1, w2)

    every = lambda a: np.broadcast_to(a, (ep, *a.shape))  # noqa: E731
    grads, (y, aux) = jax.jit(jaxpg.spmd(per_rank, group=group))(
        every(x), every(gate_w), w1.reshape(ep, E // ep, D, F), w2.reshape(ep, E // ep, F, D),
        every(cot))
    _, want_grads = reference_loss_and_grads(x, gate_w, w1, w2, cot, **options)
    y_ref, aux_ref, counts_ref, dropped_ref = reference_moe(x, gate_w, w1, w2, **options)
    for r in range(ep):
        np.testing.assert_allclose(np.asarray(y[r]), y_ref, rtol=TOL, atol=TOL)
        np.testing.assert_allclose(np.asarray(grads[0][r]), want_grads[0], rtol=TOL, atol=TOL)
        np.testing.assert_allclose(np.asarray(grads[1][r]), want_grads[1], rtol=TOL, atol=TOL)
    np.testing.assert_allclose(np.asarray(grads[2]).reshape(E, D, F), want_grads[2],
                               rtol=TOL, atol=TOL)
    np.testing.assert_allclose(np.asarray(grads[3]).reshape(E, F, D), want_grads[3],
                               rtol=TOL, atol=TOL)
    np.testing.assert_allclose(np.asarray(aux.loss), np.full(ep, aux_ref), rtol=TOL)
    np.testing.assert_array_equal(np.asarray(aux.counts), np.tile(counts_ref, (ep, 1)))
    np.testing.assert_array_equal(np.asarray(aux.dropped), np.full(ep, dropped_ref))


def test_traced_global_arrays_outside_spmd_code_run_the_whole_layer():
    # jax.jit (or eval_shape) of the layer's global arrays, every expert held: plain code
    # that XLA partitions as the arrays are laid out; the values are the one-device ones.
    ep = 4
    x, gate_w, w1, w2, _ = _inputs(ep, seed=3)
    group = jaxpg.new_group(list(range(ep)))
    y, aux = jax.jit(lambda *a: moe(*a, group=group, top_k=2))(x, gate_w, w1, w2)
    y_ref, loss_ref, counts_ref, _ = reference_moe(x, gate_w, w1, w2, top_k=2)
    np.testing.assert_allclose(np.asarray(y), y_ref, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(float(aux.loss), loss_ref, rtol=TOL)
    np.testing.assert_array_equal(np.asarray(aux.counts), counts_ref)


def _pair_max_numpy(x, gate_w, ep, top_k, capacity_factor):
    """The most kept choices one rank sends another, from the one-device reference's keep."""
    keep, _, _ = reference_keep(x, gate_w, top_k=top_k, capacity_factor=capacity_factor)
    experts = np.argsort(-(x @ gate_w), axis=1, kind="stable")[:, :top_k]
    keep = np.asarray(keep)
    pairs = np.zeros((ep, ep), int)
    for t in range(x.shape[0]):
        for j in range(top_k):
            if keep[t, j]:
                pairs[t // T, experts[t, j] // (E // ep)] += 1
    return pairs.max()


@pytest.mark.parametrize("ep,top_k,capacity_factor", [(2, 2, None), (4, 2, None),
                                                      (4, 2, 1.0), (2, 1, 1.25)])
def test_kept_pair_max_counts_what_each_rank_sends_each_rank(ep, top_k, capacity_factor):
    from jaxpg.expert_parallel.dispatch import kept_pair_max
    from jaxpg.expert_parallel.moe import expert_capacity

    x, gate_w, *_ = _inputs(ep, seed=3)
    experts = np.argsort(-(x @ gate_w), axis=1, kind="stable")[:, :top_k]
    onehot = np.eye(E, dtype=np.int32)[experts]  # (ep * T, k, E)
    counts = onehot.reshape(ep, T, top_k, E).sum(axis=1)
    capacity = expert_capacity(capacity_factor, ep * T, top_k, E)
    assert int(kept_pair_max(jnp.asarray(counts), capacity)) == _pair_max_numpy(
        x, gate_w, ep, top_k, capacity_factor)


def _routed_inputs(ep, routing):
    """Inputs whose routing is known: ``spread`` sends local token t's two choices to rank
    t mod ep (at most 4 choices per pair of ranks), ``skewed`` every choice to rank 0."""
    x, gate_w, w1, w2, cot = _inputs(ep, seed=5)
    x, gate_w = 0.1 * x, 0.1 * gate_w + 10.0 * np.eye(D, E, dtype=np.float32)
    for t in range(ep * T):
        first = 2 * (t % T) % E if routing == "spread" else 0
        x[t, first], x[t, first + 1] = 3.0, 2.9
    return x, gate_w, w1, w2, cot


@pytest.mark.parametrize("routing,buffer_factor,fits", [
    ("spread", 2.0, True), ("spread", 1.0, False), ("skewed", 2.0, False), ("spread", None, None),
])
def test_first_try_buffers_and_their_fallback_equal_the_reference(routing, buffer_factor,
                                                                   fits):
    """The first-try buffers (where the routing fits them) and the worst-case fallback
    (where it does not) give the one-device values."""
    ep, top_k = 4, 2
    x, gate_w, w1, w2, cot = _routed_inputs(ep, routing)
    options = dict(top_k=top_k, capacity_factor=None, normalize_topk=True)
    want, want_grads = reference_loss_and_grads(x, gate_w, w1, w2, cot, **options)
    if buffer_factor is not None:  # the case runs the branch it names
        first = int(np.ceil(buffer_factor * T * top_k / ep))
        assert (_pair_max_numpy(x, gate_w, ep, top_k, None) <= first) == fits
    group = jaxpg.new_group(list(range(ep)))
    stacked = _stacked(ep, x, gate_w, w1, w2, cot)
    (got, _), grads = jax.jit(jax.value_and_grad(
        _ep_loss(ep, group, buffer_factor=buffer_factor, **options), argnums=(0, 1, 2, 3),
        has_aux=True))(*stacked)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
    _assert_grads(grads, want_grads, ep)


def test_buffer_factor_below_one_is_refused():
    with pytest.raises(ValueError, match=r"buffer_factor=0.5 must be a number >= 1"):
        moe(*_inputs(1)[:4], top_k=2, buffer_factor=0.5)
