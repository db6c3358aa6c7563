"""Per-backend eager semantics in one process: the semantics switch, the watchdog, the
fingerprints and the one-rank (flat) kernels."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpg
from jaxpg.supervision import desync, watchdog


@pytest.mark.parametrize("env,platform,want", [
    ({}, "cpu", True),
    ({}, "gpu", False),
    ({}, "tpu", False),
    ({"JAXPG_BLOCKING_WAIT": "1"}, "gpu", True),
    ({"TORCH_NCCL_BLOCKING_WAIT": "1"}, "gpu", True),
    ({"JAXPG_BLOCKING_WAIT": "0"}, "cpu", False),
    ({"_JAXPG_STREAM_SEMANTICS": "1"}, "cpu", False),
    ({"_JAXPG_STREAM_SEMANTICS": "1", "JAXPG_BLOCKING_WAIT": "1"}, "cpu", True),
])
def test_blocking_wait_follows_torch(monkeypatch, env, platform, want):
    for name in ("JAXPG_BLOCKING_WAIT", "TORCH_NCCL_BLOCKING_WAIT", "_JAXPG_STREAM_SEMANTICS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert watchdog.blocking_wait(platform) is want


class _NeverReady:
    def is_ready(self) -> bool:
        return False

    def is_deleted(self) -> bool:
        return False


def test_watchdog_fires_once_the_deadline_passes_and_skips_finished_work(monkeypatch):
    monkeypatch.setenv("JAXPG_ASYNC_ERROR_HANDLING", "0")  # print, do not end pytest
    dog = watchdog._Watchdog(autostart=False)
    done = dog.watch(time.monotonic() - 1.0, lambda: "finished one")
    done.array = jnp.ones(2)
    late = dog.watch(time.monotonic() - 1.0, lambda: "all_reduce on group 'WORLD' (seq 7)")
    late.array = _NeverReady()
    future = dog.watch(time.monotonic() + 60.0, lambda: "not yet")
    future.array = _NeverReady()
    dog._check()
    assert dog.fired == "all_reduce on group 'WORLD' (seq 7)"
    assert list(dog._pending) == [future]  # the finished and the fired ones are gone
    dog.forget()  # else its thread fires "not yet" 60 s later, unpatched, and ends pytest


def test_watchdog_takes_an_output_donated_to_the_next_step_as_finished(monkeypatch):
    # a stream-ordered train step's state is donated to the next step before the watchdog
    # looks at it: that is not a failure (the next step is watched in its turn)
    monkeypatch.setenv("JAXPG_ASYNC_ERROR_HANDLING", "0")
    dog = watchdog._Watchdog(autostart=False)
    state = jnp.ones(4) + 0
    entry = dog.watch(time.monotonic() + 60.0, lambda: "step #1", failure=lambda e: e)
    entry.array = state
    jax.jit(lambda s: s * 2, donate_argnums=0)(state)
    assert state.is_deleted()
    dog._check()
    assert dog.fired is None and not dog._pending
    dog.forget()


def test_watchdog_watches_a_dispatch_that_never_returns(monkeypatch):
    monkeypatch.setenv("JAXPG_ASYNC_ERROR_HANDLING", "0")
    dog = watchdog._Watchdog(autostart=False)
    dog.watch(time.monotonic() - 1.0, lambda: "stuck in dispatch")  # no array yet
    dog._check()
    assert dog.fired == "stuck in dispatch"


def test_watchdog_thread_fires_in_the_background(monkeypatch, capsys):
    monkeypatch.setenv("JAXPG_ASYNC_ERROR_HANDLING", "0")
    dog = watchdog._Watchdog()
    dog.watch(time.monotonic() + 0.05, lambda: "background timeout").array = _NeverReady()
    deadline = time.monotonic() + 10
    while dog.fired is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dog.fired == "background timeout"
    assert "[jaxpg watchdog] DistTimeoutError: background timeout" in capsys.readouterr().err


def test_fingerprint_text_and_mismatch_name_the_odd_rank():
    fp = ("all_reduce", jaxpg.ReduceOp.SUM, (("x", (4,), "float32"),))
    text = desync.fingerprint_text("WORLD", 3, fp)
    assert text == "all_reduce(group='WORLD', seq=3, x=float32[4], args=ReduceOp.SUM)"
    other = desync.fingerprint_text("WORLD", 3, ("all_reduce", jaxpg.ReduceOp.SUM,
                                                 (("x", (8,), "float32"),)))
    assert desync.describe_mismatch({0: text, 1: text, 2: text}) is None
    msg = desync.describe_mismatch({0: text, 1: other, 2: text})
    assert msg.startswith("ranks [1] differ from rank 0")
    assert text in msg and other in msg


@pytest.mark.parametrize("value,want", [("DETAIL", True), ("detail", True), ("INFO", False),
                                        ("", False)])
def test_detail_switch(monkeypatch, value, want):
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    monkeypatch.setenv("JAXPG_DEBUG", value)
    assert desync.detail_enabled() is want
    monkeypatch.delenv("JAXPG_DEBUG")
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", value)
    assert desync.detail_enabled() is want


def test_one_rank_group_takes_and_returns_per_rank_arrays(world):
    solo = jaxpg.new_group([5])
    x = jax.device_put(jnp.arange(6.0).reshape(2, 3), world.devices[0])  # another device
    out = jaxpg.all_reduce(x, group=solo)
    assert out.shape == (2, 3) and list(out.devices()) == [world.devices[5]]
    np.testing.assert_array_equal(np.asarray(out), np.arange(6.0).reshape(2, 3))
    scalar = jaxpg.all_reduce(jnp.float32(2.5), group=solo, op=jaxpg.ReduceOp.MAX)
    assert scalar.shape == () and float(scalar) == 2.5
    with pytest.warns(UserWarning, match="float64 and becomes float32"):  # x64 is off
        gathered = jaxpg.all_gather_into_tensor(np.ones(3), group=solo)
    assert gathered.shape == (3,) and gathered.dtype == jnp.float32
    work = jaxpg.broadcast(x, src=5, group=solo, async_op=True)
    np.testing.assert_array_equal(np.asarray(work.result()), np.asarray(x))


def test_runner_keeps_call_order_and_starts_afresh_after_abandon():
    import concurrent.futures
    import threading

    from jaxpg.supervision.runner import _Runner

    runner = _Runner()
    gate, order = threading.Event(), []
    stuck = runner.submit(lambda: gate.wait(), "stuck")
    behind = runner.submit(lambda: order.append("behind") or "behind", "behind")
    with pytest.raises(concurrent.futures.TimeoutError):
        stuck.result(0.05)
    assert not runner.idle() and runner.current is stuck
    runner.abandon()  # as a timeout does: later calls get a fresh thread
    assert runner.idle()
    fresh = runner.submit(lambda: order.append("fresh") or 7, "fresh")
    assert fresh.result(10) == 7 and runner.idle()
    gate.set()  # the abandoned thread finishes its jobs, in order, on its own counters
    assert stuck.result(10) is True and behind.result(10) == "behind"
    assert order == ["fresh", "behind"] and runner.idle()
