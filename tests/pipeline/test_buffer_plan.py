"""plan_buffers: slot assignment and timetable validation."""

import numpy as np
import pytest

from jaxpg.pipeline.lockstep.buffer_plan import NUM_COLUMNS, plan_buffers
from jaxpg.pipeline.schedule.builders import get_schedule
from jaxpg.pipeline.schedule.checker import peak_in_flight
from jaxpg.pipeline.schedule.timetable import Action, Timetable


@pytest.mark.parametrize(
    "name,p,m,v",
    [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("zb_h1", 4, 8, 1), ("interleaved_1f1b", 4, 8, 2)],
)
def test_slots_match_peak_in_flight(name, p, m, v):
    tt = get_schedule(name, p, m, v)
    plan = plan_buffers(tt)
    assert plan.table.shape == (tt.num_ticks, p, NUM_COLUMNS)
    assert plan.num_act_slots == max(peak_in_flight(tt))
    assert (plan.table[:, :, 3:] < max(plan.num_act_slots, plan.num_grad_slots)).all()


def test_1f1b_slots_independent_of_m():
    assert {plan_buffers(get_schedule("1f1b", 4, m)).num_act_slots for m in (4, 8, 32)} == {4}


def test_every_slot_read_was_written():
    tt = get_schedule("1f1b", 2, 3)
    plan = plan_buffers(tt)
    # rank 1 (last stage) receives microbatch 0's activation at the end of tick 0
    assert plan.table[0, 1, 5] >= 0
    names = [plan.branches[b] for b in plan.table[:, 1, 0]]
    assert names[1] == "F_last"
    assert plan.table[1, 1, 3] == plan.table[0, 1, 5]
    assert np.all(plan.table[:, 0, 5] == -1)  # rank 0 never receives a forward (v == 1)


def _tt(grid, split=False):
    return Timetable("bad", 2, 1, 1, split, tuple(tuple(r) for r in grid))


def test_dependency_violation_is_reported():
    grid = [[Action("F", 0), Action("F", 0)], [Action("B", 0), None], [None, Action("B", 0)]]
    with pytest.raises(ValueError, match=r"F\(microbatch=0, stage=1\) at tick 0 on rank 1"):
        plan_buffers(_tt(grid))


def test_missing_action_is_reported():
    grid = [[Action("F", 0), None], [None, Action("F", 0)], [None, Action("B", 0)]]
    with pytest.raises(ValueError, match=r"never runs B\(microbatch=0, stage=0\)"):
        plan_buffers(_tt(grid))
