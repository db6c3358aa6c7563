"""Cost-weighted timetables: event-driven replay, the lockstep tick's price, pictures."""

from __future__ import annotations

import pytest

from jaxpg.pipeline.schedule.builders import get_schedule, one_f_one_b
from jaxpg.pipeline.schedule.checker import check_timetable, peak_in_flight
from jaxpg.pipeline.schedule.costs import (
    ActionCosts,
    default_costs,
    ideal_step_time,
    lockstep_time,
    timed,
)
from jaxpg.pipeline.schedule.render import render_png
from jaxpg.pipeline.stage.measured_costs import measure_costs


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 5)])
def test_one_f_one_b_with_whole_backward_costs_three_units_per_microbatch(p, m):
    tt = one_f_one_b(p, m)
    assert default_costs(tt) == ActionCosts(1.0, 2.0, 0.0)
    replay = timed(tt)
    # The papers' 1F1B: (m + p - 1) (T_F + T_B), bubble (p - 1) / (m + p - 1).
    assert replay.makespan == 3 * (m + p - 1)
    assert replay.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    # Lockstep ticks last as long as their slowest action: an F beside a B waits.
    assert lockstep_time(tt) > replay.makespan


@pytest.mark.parametrize("name, v", [("zb_h1", 1), ("zb_v", 2)])
def test_zero_bubble_in_unit_costs_equals_ticks(name, v):
    tt = get_schedule(name, 4, 8, v)
    replay = timed(tt)
    assert replay.makespan == lockstep_time(tt) == tt.num_ticks
    assert replay.bubble_fraction == pytest.approx(tt.bubble_fraction)


def test_uneven_costs_move_the_zero_bubble_schedule():
    tt = get_schedule("zb_h1", 4, 8)
    slow_w = timed(tt, ActionCosts(1.0, 1.0, 2.0))
    # Every rank does 8 F + 8 B + 8 W = 32 units; the replay can only be longer.
    assert slow_w.busy == 4 * 32
    assert slow_w.makespan >= 32
    assert lockstep_time(tt, ActionCosts(1.0, 1.0, 2.0)) >= slow_w.makespan


@pytest.mark.parametrize("p, m", [(2, 2), (2, 3), (4, 8), (4, 5)])
def test_split_one_f_one_b_removes_the_lockstep_wait(p, m):
    whole, split = one_f_one_b(p, m), one_f_one_b(p, m, split_backward=True)
    check_timetable(split)
    assert split.split_backward and split.num_ticks == 3 * m + 2 * (p - 1)
    assert peak_in_flight(split) == peak_in_flight(whole)
    # Unit ticks: the lockstep price is the time, and below the whole-backward 1F1B's.
    assert lockstep_time(split) == timed(split).makespan == split.num_ticks
    assert split.num_ticks < timed(whole).makespan < lockstep_time(whole)


def test_bad_costs_and_split_flag():
    with pytest.raises(ValueError, match="ActionCosts W=0.0 must be positive for 'zb_h1'"):
        timed(get_schedule("zb_h1", 2, 2), ActionCosts(1.0, 1.0, 0.0))
    with pytest.raises(TypeError, match="split_backward=1 must be True or False"):
        one_f_one_b(2, 2, split_backward=1)


def test_measured_costs_are_positive_and_split_shares_the_backward():
    import jax.numpy as jnp

    def block(w, x):
        return jnp.tanh(x @ w)

    w, x = jnp.ones((64, 64)) * 0.01, jnp.ones((32, 64))
    whole = measure_costs(block, w, x, split_backward=False, repeats=3)
    split = measure_costs(block, w, x, split_backward=True, repeats=3)
    assert whole.F == split.F == 1.0
    assert whole.B > 0 and split.B > 0 and split.W > 0 and whole.W == 0.0


def test_render_png_by_cost_width(tmp_path):
    path = tmp_path / "costs.png"
    render_png(get_schedule("1f1b", 4, 8), path, costs=ActionCosts(1.0, 2.0, 0.0))
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.parametrize("p,m", [(1, 1), (2, 8), (4, 8), (4, 3), (8, 32)])
def test_ideal_step_time_is_gpipes_replayed_makespan(p, m):
    # equal F and whole-B costs on every stage: the event-driven replay of GPipe takes
    # m + p - 1 slots of one microbatch's stage work, which is the bound
    costs = ActionCosts(F=1.0, B=2.0)
    one_device = 3.0 * m * p  # every microbatch through every stage, one after another
    assert ideal_step_time(one_device, p, m) == timed(get_schedule("gpipe", p, m), costs).makespan


@pytest.mark.parametrize("bad", [{"p": 0, "m": 8}, {"p": 2, "m": 2.0}, {"p": True, "m": 8}])
def test_ideal_step_time_names_a_bad_degree(bad):
    with pytest.raises(ValueError, match="ideal_step_time: [pm]="):
        ideal_step_time(1.0, **bad)
