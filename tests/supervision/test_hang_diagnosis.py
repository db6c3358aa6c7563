"""The text of a named hang, from what the peers answer and what they published (the
store round trips are replaced by canned answers; tests/multiprocess/test_hangs_mp.py runs
the real ones across processes)."""

from __future__ import annotations

import types

import pytest

from jaxpg.stores import HashStore
from jaxpg.supervision import fr_requests, hang_diagnosis, liveness
from jaxpg.supervision.flight_recorder import _Recorder

STEP = "DistributedDataParallel.train_step"


def _call(seq, op, state="started", kind="collective", text=None, **extra):
    return {"seq": seq, "op": op, "state": state, "kind": kind,
            "text": text or f"{op}(group='WORLD', seq={seq})", **extra}


@pytest.fixture
def world(monkeypatch):
    """Four processes, one rank each; this is process 0. Returns a setter for what the
    peers answer, published, and which are lost, left, stopped or gone."""
    state = types.SimpleNamespace(devices=[types.SimpleNamespace(process_index=p)
                                           for p in range(4)], process_index=0)
    group = types.SimpleNamespace(_world=state, group_name="WORLD", members=(0, 1, 2, 3),
                                  ranks=(0, 1, 2, 3), store=HashStore())
    facts = {"answers": {}, "lost": [], "left": [], "local": {}}
    rec = _Recorder()
    monkeypatch.setattr(hang_diagnosis, "recorder", rec)
    monkeypatch.setattr(fr_requests, "request", lambda *a, **k: 7)
    monkeypatch.setattr(fr_requests, "collect", lambda gen, procs, grace, lost: {
        p: facts["answers"].get(p) for p in procs})
    monkeypatch.setattr(fr_requests, "process_state", lambda p: facts["local"].get(p))
    monkeypatch.setattr(liveness, "lost", lambda: facts["lost"])
    monkeypatch.setattr(liveness, "left", lambda: facts["left"])

    def mine(seq, op, kind="collective", fingerprint=None):
        rec.start(group, seq, op, kind, fingerprint or (op, None, ()), None)

    def answer(p, call):
        facts["answers"][p] = {"calls": {"WORLD": call}}

    def publish(p, seq, text=None):
        group.store.set(f"progress/{p}", str(seq))
        if text:
            group.store.set(f"running/{p}", text)

    return types.SimpleNamespace(group=group, facts=facts, mine=mine, answer=answer,
                                 publish=publish)


def _diagnose(w, api, seq, **kw):
    return hang_diagnosis.diagnose(w.group, api, seq, 6.0, **kw)


@pytest.mark.parametrize("me_odd", [False, True])
def test_uneven_data_names_the_rank_in_another_call_on_every_rank(world, me_odd):
    w = world
    w.mine(7, "barrier" if me_odd else STEP, "collective" if me_odd else "step")
    w.answer(1, _call(7, STEP if me_odd else "barrier", kind="step" if me_odd else "collective",
                      location="train.py:5"))
    w.answer(2, _call(7, STEP, kind="step"))
    w.answer(3, _call(7, STEP, kind="step"))
    d = _diagnose(w, "barrier" if me_odd else STEP, 7)
    odd = 0 if me_odd else 1
    where = "" if me_odd else " at train.py:5"
    assert d.text.startswith(
        f"{STEP} #7 on group 'WORLD' did not finish within 6.0 s: rank {odd} never started it "
        f"(its last call: barrier #7, waiting{where}); ranks that did not arrive: [{odd}].")
    assert "ddp.join()" in d.text and not d.extend and d.at_fault == [odd]


def test_behind_lost_left_stopped_and_dead_ranks_are_each_named(world):
    w = world
    w.mine(9, "all_reduce", fingerprint=("all_reduce", None, (("x", (4,), "float32"),)))
    w.answer(1, _call(8, "all_reduce", state="completed"))
    w.facts["local"] = {2: ("stopped", 4242), 3: ("gone", 4343)}
    w.publish(2, 9, "all_reduce(group='WORLD', seq=9, x=float32[4])")
    w.publish(3, 8)
    d = _diagnose(w, "all_reduce", 9)
    assert "rank 1 never started it (its last call: all_reduce #8, finished)" in d.text
    assert ("rank 2 is stopped (its process 4242 on this host is in state T: SIGSTOP, or a "
            "debugger); its last call known: all_reduce #9;") in d.text
    assert ("rank 3 died (its process 4343 on this host is gone); its last call known: "
            "call #8 (it never reported starting this one)") in d.text
    assert d.text.endswith("ranks that did not arrive: [1, 3].") and d.at_fault == [1, 2, 3]
    w.facts["answers"].clear()
    w.facts.update(lost=[1], left=[2], local={})
    w.publish(1, 9)
    w.publish(3, 9, "all_reduce(group='WORLD', seq=9, x=float32[4])")
    d = _diagnose(w, "all_reduce", 9, failure="Gloo all-reduce failed: Connection closed")
    assert d.text.startswith("all_reduce #9 on group 'WORLD' failed (Gloo all-reduce failed: "
                             "Connection closed): rank 1 died (the coordination service lost "
                             "it) after its last call: call #9")
    assert "rank 2 left the job (its script ended) after its last call: all_reduce #9" in d.text
    assert "rank 3 does not answer (stopped, dead, or hung where Python cannot run)" in d.text


def test_a_peer_still_compiling_the_same_call_is_no_hang(world):
    w = world
    w.mine(4, STEP, "step")
    w.answer(1, _call(4, STEP, kind="step", compiling=True))
    w.answer(2, _call(4, STEP, kind="step"))
    w.answer(3, _call(4, STEP, kind="step"))
    d = _diagnose(w, STEP, 4)
    assert d.extend and d.at_fault == []
    assert "every rank started it and waits in it" in d.text
    w.answer(3, _call(3, STEP, kind="step", state="completed"))  # and one is behind
    assert not _diagnose(w, STEP, 4).extend


def test_same_op_with_other_shapes_shows_both_fingerprints(world):
    w = world
    fp = ("all_reduce", "ReduceOp.SUM", (("x", (4,), "float32"),))
    w.mine(2, "all_reduce", fingerprint=fp)
    text4 = "all_reduce(group='WORLD', seq=2, x=float32[4], args='ReduceOp.SUM')"
    for p in (1, 2):
        w.answer(p, _call(2, "all_reduce", text=text4))
    w.answer(3, _call(2, "all_reduce", text=text4.replace("[4]", "[8]")))
    d = _diagnose(w, "all_reduce", 2)
    assert "every rank started it and waits in it" in d.text
    assert "ranks [3] differ from rank 0" in d.text and "x=float32[8]" in d.text
    assert "JAXPG_DEBUG=DETAIL" in d.text


def test_a_group_held_by_this_process_alone_says_so(world):
    w = world
    w.group.members = (0,)
    d = _diagnose(w, "all_reduce", 3)
    assert "this process holds every rank of the group" in d.text
