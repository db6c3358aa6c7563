"""The flight recorder in one process: its variables, the ring buffer, the records, the dump
format (partial files included), the failure hook and the compile clock."""

from __future__ import annotations

import json
import sys
import threading
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxpg import errors
from jaxpg.supervision import compile_clock, fr_dump, watchdog
from jaxpg.supervision.flight_recorder import (
    ENV_NAMES,
    _Recorder,
    buffer_size_from_env,
    capture_caller,
)


@pytest.fixture
def clean_env(monkeypatch):
    for name in (*ENV_NAMES, "JAXPG_FR_DUMP_DIR", "TORCH_FR_DUMP_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _group(name="WORLD", ranks=(0, 1, 2)):
    return types.SimpleNamespace(group_name=name, ranks=ranks)


def _state(rank=1):
    return types.SimpleNamespace(local_ranks=[rank], devices=[0, 1, 2], process_index=rank,
                                 process_count=3)


@pytest.mark.parametrize("env, want", [
    ({}, 0),
    ({"JAXPG_FR_BUFFER_SIZE": "2000"}, 2000),
    ({"TORCH_FR_BUFFER_SIZE": "64"}, 64),
    ({"TORCH_NCCL_TRACE_BUFFER_SIZE": "8"}, 8),
    ({"JAXPG_FR_BUFFER_SIZE": "5", "TORCH_FR_BUFFER_SIZE": "64"}, 5),
])
def test_buffer_size_reads_jaxpg_and_torch_names(clean_env, env, want):
    for name, value in env.items():
        clean_env.setenv(name, value)
    assert buffer_size_from_env() == want


@pytest.mark.parametrize("value", ["-1", "many", "1.5"])
def test_a_bad_buffer_size_names_the_variable(clean_env, value):
    clean_env.setenv("TORCH_FR_BUFFER_SIZE", value)
    with pytest.raises(ValueError, match=rf"TORCH_FR_BUFFER_SIZE='{value}' must be a "
                                         "non-negative integer"):
        buffer_size_from_env()


def test_the_ring_keeps_the_last_n_calls_and_each_groups_last_one():
    rec = _Recorder()
    rec.configure(3)
    made = [rec.start(_group("WORLD" if i % 2 else "g"), i, "all_reduce", "collective",
                      ("all_reduce", None, (("x", (4,), "float32"),)), None) for i in range(5)]
    assert rec.records() == made[2:]
    assert rec.last == {"g": made[4], "WORLD": made[3]}
    assert rec.groups == {"g": (0, 1, 2), "WORLD": (0, 1, 2)}
    made[4].complete()
    made[3].fail("timed out", "late")
    made[3].fail("failed", "later")  # the first failure stands
    assert (made[4].state, made[3].state, made[3].error) == ("completed", "timed out", "late")
    lone = rec.start(_group("lone"), 7, "barrier", "collective", None, None)
    lone_id = lone.id
    for i in range(3):  # its ring slot is reused: the group's last call is copied out
        stale = rec.start(_group(), 10 + i, "all_reduce", "collective", None, None)
    assert (rec.last["lone"].id, rec.last["lone"].seq, rec.last["lone"].op) == (lone_id, 7,
                                                                                "barrier")
    assert lone.id != lone_id and rec.last["lone"] is not lone
    lone.complete(rid=lone_id)  # a late completion does not touch the slot's new call
    assert lone.state == "started" and len(rec.records()) == 3 and stale.seq == 12
    off = _Recorder()
    off.configure(0)
    kept = [off.start(_group(), i, "barrier", "collective", None, None) for i in range(4)]
    assert not off.enabled and off.records() == kept[-1:]


def _looks_up():  # stands for the jaxpg function that looks the caller up
    return capture_caller()


def test_the_caller_is_the_first_frame_outside_jaxpg():
    code, lineno, api = _looks_up()
    here = sys._getframe().f_lineno - 1
    assert code is test_the_caller_is_the_first_frame_outside_jaxpg.__code__
    assert api is None  # called from here directly, not through a jaxpg function
    assert lineno == here


def test_a_public_collective_pins_its_caller_for_every_record_it_makes():
    from jaxpg.supervision import flight_recorder

    namespace = {"capture_caller": capture_caller, "call_pinned": flight_recorder.call_pinned}
    exec(compile("def all_reduce_like():\n    return capture_caller(), capture_caller()\n"
                 "def wrapper():\n    return call_pinned(all_reduce_like, (), {})\n"
                 "def lookup():\n    return capture_caller()\n",
                 flight_recorder._PACKAGE + "fake_api.py", "exec"), namespace)
    first, second = namespace["wrapper"]()
    here = sys._getframe().f_lineno - 1
    me = test_a_public_collective_pins_its_caller_for_every_record_it_makes.__code__
    assert first == second == (me, here, namespace["all_reduce_like"].__code__)
    code, line, api = namespace["lookup"]()  # nothing pinned is left behind: a walk
    assert (code, line, api) == (me, sys._getframe().f_lineno - 1, None)


def test_a_collective_under_another_decorator_still_pins_the_users_line():
    # the public collectives are wrapped twice (the discarded-result check outside the
    # async/pinning wrapper): the pin must skip the outer wrapper, not name it
    from jaxpg.supervision import flight_recorder

    namespace = {"capture_caller": capture_caller, "call_pinned": flight_recorder.call_pinned}
    exec(compile("def all_gather_like():\n    return capture_caller()\n"
                 "def inner():\n    return call_pinned(all_gather_like, (), {})\n"
                 "def wrapper():\n    return inner()\n",
                 flight_recorder._PACKAGE + "fake_api2.py", "exec"), namespace)
    namespace["inner"].__code__ = namespace["inner"].__code__.replace(co_name="wrapper")
    got = namespace["wrapper"]()
    here = sys._getframe().f_lineno - 1
    me = test_a_collective_under_another_decorator_still_pins_the_users_line.__code__
    assert got == (me, here, namespace["all_gather_like"].__code__)


def test_dump_prefix_honours_the_dump_dir_and_torchs_prefix(clean_env, tmp_path):
    assert fr_dump.dump_prefix().endswith("jaxpg_fr_rank_")
    clean_env.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "trace_"))
    assert fr_dump.dump_prefix() == str(tmp_path / "trace_")
    clean_env.setenv("JAXPG_FR_DUMP_DIR", str(tmp_path / "d"))
    assert fr_dump.dump_prefix() == str(tmp_path / "d" / "jaxpg_fr_rank_")


def test_a_dump_round_trips_and_a_cut_one_keeps_what_it_holds(clean_env, tmp_path, monkeypatch):
    rec = _Recorder()
    rec.configure(10)
    monkeypatch.setattr(fr_dump, "recorder", rec)
    a = rec.start(_group(), 1, "all_reduce", "collective",
                  ("all_reduce", "ReduceOp.SUM", (("x", (4,), "float32"),)), _looks_up())
    a.complete()
    b = rec.start(_group("p2p_0_1", (0, 1)), 1, "send", "collective",
                  ("send", (0, 1), (("x", (2, 3), "bfloat16"),)), None)
    c = rec.start(_group(), 2, "DistributedDataParallel.train_step", "step",
                  ("DistributedDataParallel.train_step", None, ()), None)
    c.collectives = ("all-reduce f32[4,2] x2",)
    c.fail("timed out", "train_step #2 ... did not finish")
    clean_env.setenv("JAXPG_FR_DUMP_DIR", str(tmp_path))
    path = fr_dump.write_dump("a test", _state(1))
    assert path == str(tmp_path / "jaxpg_fr_rank_1")
    dump = fr_dump.read_dump(path)
    assert not dump.partial
    assert (dump.header["format"], dump.header["version"]) == ("jaxpg-flight-recorder", 1)
    assert dump.header["trigger"] == "a test" and dump.header["ranks"] == [1]
    assert dump.header["groups"]["WORLD"] == {"ranks": [0, 1, 2], "last_seq": 2}
    first, send, step = dump.calls
    assert (first["op"], first["seq"], first["inputs"], first["args"], first["state"]) == (
        "all_reduce", 1, [["x", [4], "float32"]], "ReduceOp.SUM", "completed")
    assert first["caller"]["file"] == __file__ and first["ended"] >= first["started"]
    assert send["args"] == {"src": 0, "dst": 1}  # the pair group's ranks, as global ranks
    assert (step["kind"], step["collectives"], step["state"]) == (
        "step", ["all-reduce f32[4,2] x2"], "timed out")
    assert b.id < c.id and [x["id"] for x in dump.calls] == [a.id, b.id, c.id]
    text = Path(path).read_text()
    cut = tmp_path / "cut"
    body = text.index("\n") + 1  # past the header line (it may quote calls too)
    cut.write_text(text[: text.index('"seq": 2', body) + 3])  # killed in the middle of a line
    partial = fr_dump.read_dump(str(cut))
    assert partial.partial and [x["id"] for x in partial.calls] == [a.id, b.id]


def test_read_dump_refuses_other_files_and_newer_versions(tmp_path):
    other = tmp_path / "x"
    other.write_text('{"hello": 1}\n')
    with pytest.raises(ValueError, match="is not a jaxpg-flight-recorder dump"):
        fr_dump.read_dump(str(other))
    newer = tmp_path / "y"
    newer.write_text(json.dumps({"type": "header", "format": "jaxpg-flight-recorder",
                                 "version": 99}) + "\n")
    with pytest.raises(ValueError, match="version 99 dump; this jaxpg reads up to version 1"):
        fr_dump.read_dump(str(newer))


def test_every_dist_failure_reaches_the_hook_and_store_errors_do_not(monkeypatch):
    seen = []
    monkeypatch.setattr(errors, "_failure_hooks", [seen.append])
    made = [errors.DistTimeoutError("t"), errors.DistNetworkError("n"),
            errors.DistDesyncError("d"), errors.DistStoreError("s"), errors.DistError("e")]
    assert seen == made[:3]
    monkeypatch.setattr(errors, "_failure_hooks", [lambda e: 1 / 0])
    assert str(errors.DistTimeoutError("a broken hook hides nothing")) == \
        "a broken hook hides nothing"


def test_the_compile_clock_counts_a_threads_compile_time_only():
    compile_clock.install()
    done = {}

    def compile_something():
        ident = threading.get_ident()
        before = compile_clock.seconds(ident)
        jax.jit(lambda x: jnp.sin(x) * 3.0 + jnp.cos(x)).lower(jnp.ones(7)).compile()
        done["spent"] = compile_clock.seconds(ident) - before
        done["compiling"] = compile_clock.compiling(ident)

    thread = threading.Thread(target=compile_something)
    thread.start()
    thread.join()
    assert done["spent"] > 0 and done["compiling"] is False
    assert compile_clock.seconds(threading.get_ident() + 12345) == 0.0


class _Failing:
    def is_deleted(self):
        return False

    def is_ready(self):
        return True

    def block_until_ready(self):
        raise RuntimeError("UNKNOWN: Gloo all-reduce failed: Connection closed by peer")


class _Never:
    def is_deleted(self):
        return False

    def is_ready(self):
        return False


def test_the_watchdog_marks_records_extends_for_compiling_peers_and_names_failures(
        monkeypatch, capsys):
    monkeypatch.setenv("JAXPG_ASYNC_ERROR_HANDLING", "0")
    dumped = []
    monkeypatch.setattr(watchdog, "_teardown_hooks", [dumped.append])  # the recorder's dump
    rec = _Recorder()
    rec.configure(4)
    dog = watchdog._Watchdog(autostart=False)
    done = rec.start(_group(), 1, "all_reduce", "collective", None, None)
    dog.watch(0.0, lambda: "never", record=done).array = jnp.ones(2)
    broken = rec.start(_group(), 2, "all_reduce", "collective", None, None)
    dog.watch(1e12, lambda: "never", record=broken,
              failure=lambda err: f"all_reduce #2 failed ({err}): rank 1 died").array = _Failing()
    answers = iter([("train_step #3: a peer still compiles", True), ("train_step #3: hung", False)])
    late = rec.start(_group(), 3, "train_step", "step", None, None)
    entry = dog.watch(0.0, lambda: next(answers), record=late)
    entry.array = _Never()
    dog._check()
    assert done.state == "completed" and broken.state == "failed"
    assert "Gloo all-reduce failed" in broken.error
    assert "[jaxpg watchdog] DistNetworkError: all_reduce #2 failed" in capsys.readouterr().err
    assert list(dog._pending) == [entry] and late.state == "started"  # extended once
    entry.deadline = 0.0
    dog._check()
    assert dog.fired == "train_step #3: hung" and late.state == "timed out"
    assert not dog._pending
    assert [d.split(":")[0] for d in dumped] == ["DistNetworkError", "DistTimeoutError"]
