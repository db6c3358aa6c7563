"""Per-rank programs of the process executor: every message made once and read once, no
deadlock, and in-order lanes that cost no time over the event-driven replay."""

from __future__ import annotations

import itertools

import pytest

from jaxpg.pipeline.process.rank_ops import pair_transfers, peers_of, rank_ops
from jaxpg.pipeline.schedule.builders import get_schedule, one_f_one_b
from jaxpg.pipeline.schedule.costs import ActionCosts, timed

CASES = [
    (name, p, m, v)
    for name, v in (("gpipe", 1), ("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2),
                    ("zb_v", 2))
    for p, m in ((2, 2), (2, 4), (3, 6), (4, 4), (4, 8), (4, 5))
    if not (name == "interleaved_1f1b" and m % p) and not (name == "zb_h1" and m < p)
]


def _tt(name, p, m, v):
    return get_schedule(name, p, m, v)


def _replay(tt, costs):
    """Event-driven run of the rank programs with in-order lanes (transfers take no time).

    Each rank runs its ops in order, each when the rank is free and the message it reads
    has arrived; a transfer on a pair's lane runs when its message is made and the lane's
    previous transfer is done. Returns the makespan, or raises if nothing can move.
    """
    p = tt.num_stages
    progs = {r: rank_ops(tt, r) for r in range(p)}
    lanes = {(a, b): pair_transfers(tt, a, b) for a, b in itertools.combinations(range(p), 2)}
    made, arrived = {}, {}  # key -> time made / time it reached its reader
    free = [0.0] * p
    nxt = dict.fromkeys(progs, 0)
    at = dict.fromkeys(lanes, 0)
    lane_free = dict.fromkeys(lanes, 0.0)
    while any(nxt[r] < len(progs[r]) for r in progs):
        moved = False
        for pair, ts in lanes.items():
            while at[pair] < len(ts) and ts[at[pair]].key in made:
                t = ts[at[pair]]
                arrived[t.key] = lane_free[pair] = max(lane_free[pair], made[t.key])
                at[pair] += 1
                moved = True
        for r, ops in progs.items():
            while nxt[r] < len(ops):
                op = ops[nxt[r]]
                if op.needs is not None and op.needs not in arrived:
                    break
                start = max([free[r]] + ([arrived[op.needs]] if op.needs else []))
                free[r] = start + costs.of(op.kind)
                if op.sends is not None:
                    key, dst = op.sends
                    made[key] = free[r]
                    if dst == r:  # the turn of a V stays on the rank
                        arrived[key] = free[r]
                nxt[r] += 1
                moved = True
        if not moved:
            raise AssertionError(f"deadlock: ranks at {nxt}, lanes at {at}")
    assert all(at[pair] == len(ts) for pair, ts in lanes.items())
    return max(free)


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_every_message_is_made_once_and_read_once_by_its_rank(name, p, m, v):
    tt = _tt(name, p, m, v)
    made, read = {}, {}
    for r in range(p):
        ops = rank_ops(tt, r)
        assert [(op.kind, op.microbatch, op.chunk) for op in ops] == [
            tuple(a) for _, a in tt.actions_of(r)]
        for op in ops:
            if op.sends is not None:
                key, dst = op.sends
                assert key not in made
                made[key] = (r, dst)
            if op.needs is not None:
                assert op.needs not in read
                read[op.needs] = r
    assert set(made) == set(read)
    assert all(made[k][1] == read[k] for k in made)
    for a, b in itertools.combinations(range(p), 2):
        moved = pair_transfers(tt, a, b)
        assert moved == pair_transfers(tt, b, a)  # both ends list the same order
        assert {t.key for t in moved} == {k for k, (s, d) in made.items() if {s, d} == {a, b}}
        if moved:
            assert b in peers_of(tt, a) and a in peers_of(tt, b)


@pytest.mark.parametrize("name, p, m, v", CASES)
@pytest.mark.parametrize("costs", [None, ActionCosts(1.0, 2.0, 1.5), ActionCosts(1.0, 0.7, 3.0)])
def test_in_order_lanes_never_deadlock_and_cost_nothing_over_the_replay(name, p, m, v, costs):
    tt = _tt(name, p, m, v)
    if costs is not None and not tt.split_backward:
        costs = ActionCosts(costs.F, costs.B, 0.0)
    replay = timed(tt, costs)
    assert _replay(tt, replay.costs) == pytest.approx(replay.makespan)


def test_split_one_f_one_b_and_accumulator_firsts():
    tt = one_f_one_b(2, 3, split_backward=True)
    ops = rank_ops(tt, 0)
    firsts = [op.label for op in ops if op.init]
    assert firsts == ["B0", "W0"]  # the embedding's gradient, then the chunk's weights
    last = rank_ops(tt, 1)
    assert [op.label for op in last if op.init] == ["F0", "W0"]
    assert all(op.last for op in last) and not any(op.first for op in last)


def test_v_layout_turn_stays_on_the_last_rank():
    tt = get_schedule("zb_v", 2, 4)
    ops = rank_ops(tt, 1)
    turns = [op for op in ops if op.sends is not None and op.sends[1] == 1]
    assert turns and all(op.stage in (1, 2) for op in turns)
    assert all(t.key[:2] != ("act", 2) for t in pair_transfers(tt, 0, 1))


def test_bad_ranks_are_named():
    tt = get_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="rank=2 must be in 0..1"):
        rank_ops(tt, 2)
    with pytest.raises(ValueError, match="two different ranks"):
        pair_transfers(tt, 1, 1)
