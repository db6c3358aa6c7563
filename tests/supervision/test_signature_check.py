"""The default desync check's pieces in one process: what a signature covers, a recorded
step's fingerprint, the OFF switch, and which step errors are XLA's collectives failing.
Across processes: tests/multiprocess/test_call_mismatch_mp.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpg
from jaxpg.supervision import collective_call, signature_check
from jaxpg.supervision.desync import fingerprint_text
from jaxpg.supervision.step_recording import _Signatures


def test_the_signature_names_op_group_shapes_dtypes_and_arguments_but_not_the_seq(world):
    fp = ("all_reduce", "ReduceOp.SUM", (("x", (4,), "float32"),))
    text = signature_check.signature_text(world, fp)
    assert text == "all_reduce(group='WORLD', x=float32[4], args='ReduceOp.SUM')", text
    assert fingerprint_text("WORLD", 3, fp).startswith("all_reduce(group='WORLD', seq=3, ")
    others = [("all_reduce", "ReduceOp.MAX", (("x", (4,), "float32"),)),
              ("all_reduce", "ReduceOp.SUM", (("x", (8,), "float32"),)),
              ("all_reduce", "ReduceOp.SUM", (("x", (4,), "int32"),)),
              ("all_gather_into_tensor", None, (("x", (4,), "float32"),))]
    digests = {signature_check._digest(signature_check.signature_text(world, f)).tobytes()
               for f in [fp, *others]}
    assert len(digests) == 5
    def gelu(x):
        return x

    here = ("moe", (2, gelu, True), (("x", (6, 8), "float32"),))
    text = signature_check.signature_text(world, here)
    assert " at 0x" not in text and "<function test_the_signature_names_op_group" in text, \
        text  # the same in every process: no memory address
    sub = jaxpg.new_group([0, 1])
    assert signature_check.signature_text(sub, fp) != signature_check.signature_text(world, fp)


def test_a_recorded_steps_fingerprint_is_its_name_and_its_arguments_shapes():
    sigs = _Signatures("train_step")
    state = {f"w{i}": jnp.zeros((i + 1, 2)) for i in range(10)}
    batch = {"x": np.zeros((8, 4), np.float32), "y": np.zeros((8,), np.int32)}
    name, static, inputs = sigs.of((state, batch, jnp.ones(3), 7, None), {"lr": 0.1})
    assert (name, static) == ("train_step", None)
    assert inputs[0][0] == "arg0" and inputs[0][1] is None
    assert inputs[0][2].startswith("<10 leaves, shapes "), inputs[0]
    assert inputs[1] == ("arg1", None, "{float32[8, 4], int32[8]}")
    assert inputs[2] == ("arg2", (3,), "float32")
    assert inputs[3] == ("arg3", None, "{int}")  # a value, not an array: its type only
    assert inputs[4] == ("lr", None, "{float}")  # arg4, None: no leaves, left out
    assert len(inputs) == 5
    text = fingerprint_text("WORLD", 2, (name, static, inputs))
    assert "arg1={float32[8, 4], int32[8]}, arg2=float32[3]" in text, text
    smaller = sigs.of((state, {"x": np.zeros((6, 4), np.float32),
                               "y": np.zeros((6,), np.int32)}, jnp.ones(3), 8, None),
                      {"lr": 0.2})
    assert smaller[2][1] == ("arg1", None, "{float32[6, 4], int32[6]}")
    assert smaller[2][3:] == inputs[3:]  # other values of plain numbers: the same signature
    wider = dict(state, w9=jnp.zeros((10, 3)))
    assert sigs.of((wider, batch, jnp.ones(3), 7, None), {"lr": 0.1})[2][0] != inputs[0]


@pytest.mark.parametrize("value, on", [(None, True), ("INFO", True), ("DETAIL", True),
                                       ("OFF", False), ("off", False)])
def test_jaxpg_debug_off_turns_the_check_off(monkeypatch, value, on):
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    if value is None:
        monkeypatch.delenv("JAXPG_DEBUG", raising=False)
    else:
        monkeypatch.setenv("JAXPG_DEBUG", value)
    assert signature_check.check_enabled() is on


@pytest.mark.parametrize("err, collective", [
    (ValueError("UNKNOWN: Gloo all-reduce failed: [pair.cc:547] Connection closed by peer"),
     True),
    (RuntimeError("INTERNAL: Gloo all-gather failed: Connection reset by peer"), True),
    (ValueError("Incompatible shapes for broadcasting: (3,) and (4,)"), False),
    (ValueError("UNKNOWN: the user's own words"), False),
    (TypeError("UNKNOWN: Gloo all-reduce failed"), False),
])
def test_a_steps_gloo_failure_is_told_from_the_users_own_error(world, err, collective):
    assert collective_call._collective_failure(err, world) is collective


def test_one_process_runs_no_check(world):
    # every rank is here: nothing to compare, the call runs as it did
    assert not world._world.multiprocess
    out = jaxpg.all_reduce(jnp.ones((8, 3)))
    np.testing.assert_allclose(np.asarray(out), np.full((8, 3), 8.0))
    assert "_jaxpg_sigcheck" not in world.__dict__


def test_the_check_kernel_gives_every_rank_the_same_verdict(world):
    # in one process every rank's digest is the same; rows that differ stand in for peers
    fp = ("all_reduce", "ReduceOp.SUM", (("x", (4,), "float32"),))
    assert not signature_check.mismatched(signature_check.dispatch(world, fp))
    kernel, sharding = signature_check._kernel(world)
    same = np.tile(signature_check._digest("a"), (8, 1))
    for odd in (0, 5, 7):
        rows = same.copy()
        rows[odd] = signature_check._digest("b")
        flags = np.asarray(kernel(jax.device_put(rows, sharding)))
        assert flags.tolist() == [1] * 8, (odd, flags)
    rows = same.copy()
    rows[3, 1] ^= 1  # one bit of one half
    assert np.asarray(kernel(jax.device_put(rows, sharding))).tolist() == [1] * 8
    assert np.asarray(kernel(jax.device_put(same, sharding))).tolist() == [0] * 8
    extreme = np.array([[0, 0x7FFFFFFF]] * 4 + [[0x7FFFFFFF, 0]] * 4, np.int32)
    assert np.asarray(kernel(jax.device_put(extreme, sharding))).tolist() == [1] * 8
