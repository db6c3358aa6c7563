"""send/recv, isend/irecv, batch_isend_irecv, permute; the metadata header; object
collectives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpg
from jaxpg.collectives.p2p_meta import TensorMeta, decode_meta, encode_meta


def test_send_recv_between_local_ranks_lands_on_receiver_device():
    x = jnp.arange(6.0).reshape(2, 3)
    jaxpg.send(x, dst=5)
    with jaxpg.as_rank(5):
        y = jaxpg.recv(src=0)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    assert y.devices() == {jax.devices()[5]}


def test_send_recv_in_a_group_with_group_ranks_and_tags():
    g = jaxpg.new_group([2, 4, 7])
    with jaxpg.as_rank(7):
        jaxpg.send(jnp.ones(2), group=g, group_dst=0, tag=1)
        jaxpg.send(jnp.zeros(2), group=g, group_dst=0, tag=2)
    with jaxpg.as_rank(2):
        assert float(jaxpg.recv(src=7, group=g, tag=2).sum()) == 0
        assert float(jaxpg.recv(jnp.empty(2), group=g, group_src=2, tag=1).sum()) == 2


def test_recv_times_out_naming_the_missing_rank():
    with pytest.raises(jaxpg.DistTimeoutError, match=r"ranks that did not arrive: \[3\]"):
        jaxpg.recv(src=3, timeout=0.05)


def test_recv_shape_mismatch():
    jaxpg.send(jnp.ones(3), dst=1)
    with jaxpg.as_rank(1), pytest.raises(ValueError, match="but rank 0 sent"):
        jaxpg.recv(jnp.ones(4), src=0)


def test_send_to_self_and_bad_peers():
    with pytest.raises(ValueError, match="cannot send to itself"):
        jaxpg.send(jnp.ones(1), dst=0)
    with pytest.raises(ValueError, match="dst=9 is not a rank"):
        jaxpg.send(jnp.ones(1), dst=9)
    with pytest.raises(ValueError, match="exactly one of dst and group_dst"):
        jaxpg.send(jnp.ones(1))


def test_isend_irecv_and_batch():
    ops = []
    for r in range(8):
        with jaxpg.as_rank(r):
            ops.append(jaxpg.batch_isend_irecv([
                jaxpg.P2POp(jaxpg.isend, jnp.full(2, float(r)), (r + 1) % 8),
                jaxpg.P2POp(jaxpg.irecv, None, (r - 1) % 8),
            ]))
    for r, (send_work, recv_work) in enumerate(ops):
        with jaxpg.as_rank(r):
            send_work.wait()
            recv_work.wait()
            np.testing.assert_array_equal(np.asarray(recv_work.result()),
                                          np.full(2, float((r - 1) % 8)))


def test_batch_isend_irecv_checks_nan_when_flag_set(monkeypatch):
    monkeypatch.setenv("JAXPG_PP_CHECK_NANINF", "1")
    with pytest.raises(ValueError, match="inf or nan values at rank 0"):
        jaxpg.batch_isend_irecv([jaxpg.P2POp(jaxpg.isend, jnp.array([1.0, jnp.nan]), 1)])
    monkeypatch.setenv("JAXPG_PP_CHECK_NANINF", "0")
    jaxpg.batch_isend_irecv([jaxpg.P2POp(jaxpg.isend, jnp.array([1.0, jnp.nan]), 1)])
    with jaxpg.as_rank(1):
        assert np.isnan(np.asarray(jaxpg.recv(src=0))[1])


def test_batch_bad_op():
    with pytest.raises(ValueError, match="must be jaxpg.isend or jaxpg.irecv"):
        jaxpg.batch_isend_irecv([jaxpg.P2POp(jaxpg.send, jnp.ones(1), 1)])


@pytest.mark.parametrize("lowering", ["eager", "spmd"])
def test_permute_ring_and_partial(lowering):
    x = jnp.arange(8.0)[:, None]
    ring = [(i, (i + 1) % 8) for i in range(8)]
    partial = [(0, 3), (3, 5)]
    if lowering == "eager":
        a, b = jaxpg.permute(x, ring), jaxpg.permute(x, partial)
    else:
        a = jaxpg.spmd(lambda v: jaxpg.permute(v, ring))(x)
        b = jaxpg.spmd(lambda v: jaxpg.permute(v, partial))(x)
    np.testing.assert_array_equal(np.asarray(a)[:, 0], np.roll(np.arange(8.0), 1))
    np.testing.assert_array_equal(np.asarray(b)[:, 0], [0, 0, 0, 0, 0, 3, 0, 0])
    with pytest.raises(ValueError, match="must not repeat"):
        jaxpg.permute(x, [(0, 1), (2, 1)])


def test_spmd_send_recv_pair_into_ppermute():
    def fn(v):
        jaxpg.send(v * 10, dst=6, src=1)
        return jaxpg.recv(v, src=1, dst=6)

    out = np.asarray(jaxpg.spmd(fn)(jnp.arange(8.0)[:, None]))[:, 0]
    np.testing.assert_array_equal(out, [0, 1, 2, 3, 4, 5, 10, 7])


def test_meta_header_round_trip_matches_seed_layout():
    metas = [TensorMeta((32, 64), "float32", False), TensorMeta((16, 32, 64), "float64", True)]
    words = encode_meta(metas, several=True)
    assert words.tolist() == [1, 2, 2, 32, 64, 1, 0, 3, 16, 32, 64, 2, 1]  # the seed's example
    assert decode_meta(words) == (metas, True)
    one = encode_meta([TensorMeta((3,), "bfloat16")], several=False)
    assert decode_meta(one) == ([TensorMeta((3,), "bfloat16")], False)
    with pytest.raises(ValueError, match="left over"):
        decode_meta([0, 1, 3, 1, 0, 99])


def test_object_collectives():
    objs = jaxpg.PerRank([{"rank": r, "arr": np.arange(r)} for r in range(8)])
    got = jaxpg.all_gather_object(objs)
    assert [o["rank"] for o in got] == list(range(8))
    np.testing.assert_array_equal(got[5]["arr"], np.arange(5))
    assert jaxpg.broadcast_object_list([1, "two", None], src=0) == [1, "two", None]
    assert jaxpg.gather_object(jaxpg.PerRank(list("abcdefgh")), dst=0) == list("abcdefgh")
    assert jaxpg.scatter_object_list([i * i for i in range(8)], src=0) == [
        i * i for i in range(8)]
    g = jaxpg.new_group([1, 3])
    assert jaxpg.gather_object(jaxpg.PerRank(["x", "y"]), dst=1, group=g) == ["x", "y"]


class Thing:
    """A class msgpack cannot encode."""


def test_objects_refuse_pickle_unless_opted_in():
    with pytest.raises(TypeError, match="allow_pickle=True"):
        jaxpg.all_gather_object(Thing())
    out = jaxpg.all_gather_object(Thing(), allow_pickle=True)
    assert all(isinstance(o, Thing) for o in out)
    from jaxpg.collectives.objects import decode_object, encode_object

    with pytest.raises(ValueError, match="unpickling runs arbitrary code"):
        decode_object(encode_object(1, allow_pickle=True), allow_pickle=False)


def test_scatter_object_list_on_wrong_rank():
    g = jaxpg.new_group([2, 3])
    with pytest.raises(ValueError, match="must be given on src=2"):
        jaxpg.scatter_object_list(None, src=2, group=g)
