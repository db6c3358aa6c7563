"""jaxpg-fr-trace on hand-made dumps: each verdict, partial and missing dumps, --json and
the exit status (tests/multiprocess/test_hangs_mp.py runs it on real ones)."""

from __future__ import annotations

import json

import pytest

from jaxpg.supervision.fr_trace import analyze, load_dumps, main

STEP = "DistributedDataParallel.train_step"


def _call(seq, op, state="completed", kind="collective", inputs=(("x", [4], "float32"),),
          line=10, group="WORLD", **extra):
    return {"type": "call", "id": seq, "group": group, "seq": seq, "op": op, "kind": kind,
            "inputs": [list(i) for i in inputs] if kind != "step" else [], "args": None,
            "state": state, "started": 1000.0 + seq, "ended": None,
            "caller": {"file": "/job/train.py", "line": line, "function": "main"}, **extra}


def _write(directory, process, calls, *, count=3, diagnosis=None, lost=(), end=True):
    header = {"type": "header", "format": "jaxpg-flight-recorder", "version": 1,
              "process": process, "process_count": count, "ranks": [process],
              "world_size": count, "trigger": "test", "errors": [], "groups": {},
              "lost_processes": list(lost), "diagnosis": diagnosis}
    lines = [json.dumps(header)] + [json.dumps(c) for c in calls]
    if end:
        lines.append(json.dumps({"type": "end", "calls": len(calls)}))
    (directory / f"jaxpg_fr_rank_{process}").write_text("\n".join(lines) + "\n")


def _verdict(directory):
    procs, _ = load_dumps([str(directory)])
    return analyze(procs)


def _steps(n):
    return [_call(1, "all_reduce")] + [_call(1 + k, STEP, kind="step", line=20)
                                       for k in range(1, n + 1)]


def test_uneven_steps_name_the_rank_that_called_something_else(tmp_path):
    for p in (0, 2):
        _write(tmp_path, p, _steps(3) + [_call(5, STEP, "timed out", "step", line=20)])
    _write(tmp_path, 1, _steps(3) + [_call(5, "barrier", "timed out", line=30,
                                           inputs=(("x", [1], "int32"),))])
    v = _verdict(tmp_path)
    assert (v["verdict"], v["group"], v["seq"], v["culprit_ranks"]) == ("mismatch", "WORLD", 5,
                                                                         [1])
    assert ("rank 1 called barrier #5 (x=int32[1]; timed out) at /job/train.py:30, where "
            f"ranks 0, 2 called {STEP} #5 (timed out) at /job/train.py:20.") in v["text"]
    assert f"Recorded calls of {STEP}: rank 0: 4; rank 1: 3; rank 2: 4" in v["text"]


def test_other_shapes_are_a_mismatch_and_name_both(tmp_path):
    _write(tmp_path, 0, [_call(1, "all_reduce"), _call(2, "all_reduce", "timed out")])
    _write(tmp_path, 1, [_call(1, "all_reduce"),
                         _call(2, "all_reduce", "timed out", inputs=(("x", [8], "float32"),))])
    _write(tmp_path, 2, [_call(1, "all_reduce"), _call(2, "all_reduce", "timed out")])
    v = _verdict(tmp_path)
    assert v["verdict"] == "mismatch" and v["culprit_ranks"] == [1]
    assert "rank 1 called all_reduce #2 (x=float32[8]; timed out)" in v["text"]


def test_ranks_that_never_arrived_and_where_they_were_instead(tmp_path):
    _write(tmp_path, 0, [_call(1, "all_reduce"), _call(2, "broadcast", "timed out")])
    _write(tmp_path, 1, [_call(1, "all_reduce"),
                         _call(1, "send", "started", group="p2p_1_2", line=44, id=99)])
    _write(tmp_path, 2, [_call(1, "all_reduce"), _call(2, "broadcast", "timed out")])
    v = _verdict(tmp_path)
    assert v["verdict"] == "not_arrived" and v["culprit_ranks"] == [1]
    assert "rank 1 never arrived at broadcast #2 on group 'WORLD'" in v["text"]
    assert "ranks 0, 2 started" in v["text"]
    assert "rank 1: send #1 on group 'p2p_1_2' (x=float32[4]; started) at /job/train.py:44" \
        in v["text"]


@pytest.mark.parametrize("status, said", [("stopped", "stopped (SIGSTOP or a debugger)"),
                                          ("gone", "dead: its process was gone"),
                                          ("no response", "it did not answer its peers")])
def test_missing_dumps_are_named_with_what_the_peers_saw(tmp_path, status, said):
    peers = {"1": {"ranks": [1], "status": status, "last_call": {"seq": 4, "op": "spmd(step)"}}}
    for p in (0, 2):
        _write(tmp_path, p, [_call(4, "spmd(step)", "timed out", "step")],
               diagnosis={"peers": peers})
    v = _verdict(tmp_path)
    assert v["verdict"] == "stuck" and v["culprit_ranks"] == [1]
    assert "ranks 0, 2 started spmd(step) #4 on group 'WORLD'" in v["text"]
    assert (f"rank 1 has no dump: {said}") in v["text"]
    assert "its last call known to its peers: spmd(step) #4" in v["text"]


def test_a_dump_cut_short_is_read_and_a_lost_process_is_named(tmp_path):
    _write(tmp_path, 0, [_call(1, "all_reduce"), _call(2, "all_reduce", "failed")], lost=[2])
    _write(tmp_path, 1, [_call(1, "all_reduce"), _call(2, "all_reduce", "failed")])
    path = tmp_path / "jaxpg_fr_rank_1"
    text = path.read_text()
    path.write_text(text[: text.rindex('"type": "end"') - 20])  # killed while writing
    procs, problems = load_dumps([str(tmp_path)])
    assert [p.dump.partial for p in procs] == [False, True]
    assert any("jaxpg_fr_rank_1: cut short" in p for p in problems), problems
    v = analyze(procs)
    assert v["culprit_ranks"] == [2] and v["missing_processes"] == [2]
    assert "rank 2 has no dump: lost: the coordination service stopped hearing from it" \
        in v["text"]
    assert "[dump cut short]" in v["text"]


def test_the_command_line_prints_json_and_exits_by_verdict(tmp_path, capsys):
    for p in range(3):
        _write(tmp_path, p, [_call(1, "all_reduce"), _call(2, "barrier")])
    assert main([str(tmp_path)]) == 0
    assert "No problem found" in capsys.readouterr().out
    _write(tmp_path, 1, [_call(1, "all_reduce"), _call(2, "all_gather_into_tensor", "started")])
    assert main([str(tmp_path), "--json"]) == 1
    v = json.loads(capsys.readouterr().out)
    assert (v["verdict"], v["culprit_ranks"], v["seq"]) == ("mismatch", [1], 2)
    assert main([str(tmp_path / "nothing_here")]) == 2
    assert "no jaxpg flight-recorder dump" in capsys.readouterr().err
    torch_named = tmp_path / "torch_named"  # TORCH_FR_DUMP_TEMP_FILE=.../trace_
    torch_named.mkdir()
    for p in (0, 2):
        (torch_named / f"trace_{p}").write_text((tmp_path / f"jaxpg_fr_rank_{p}").read_text())
    (torch_named / "unrelated.txt").write_text("not a dump")
    assert main([str(torch_named), "--prefix", "trace_"]) == 1
    out = capsys.readouterr().out
    assert "2 dumps (ranks 0, 2)" in out and "rank 1 has no dump" in out
