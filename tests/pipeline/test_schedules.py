"""Schedules as data: every timetable passes the checker and matches the papers' numbers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from _require import import_or_skip

from jaxpg.pipeline.schedule.builders import (
    available_schedules,
    dualpipe_v,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    looped_bfs,
    one_f_one_b,
    theory_bubble_fraction,
    theory_ticks,
    zero_bubble_h1,
    zero_bubble_v,
)
from jaxpg.pipeline.schedule.checker import (
    check_bubble,
    check_timetable,
    default_in_flight_limits,
    paper_bubble,
    peak_in_flight,
)
from jaxpg.pipeline.schedule.costs import ActionCosts
from jaxpg.pipeline.schedule.timetable import KIND_CODES, Action, Timetable

# (name, p, m, v): m = p, m = 2p, and m not a multiple of p where the schedule allows it.
CONFIGS = [
    (name, p, m, 1)
    for name in ("gpipe", "1f1b", "zb_h1")
    for p, m in [(2, 2), (2, 4), (2, 3), (4, 4), (4, 8), (4, 6)]
] + [("interleaved_1f1b", p, m, v) for p, m in [(2, 2), (2, 4), (4, 4), (4, 8)] for v in (2,)]
CONFIGS += [("interleaved_1f1b", 4, 8, 3), ("gpipe", 4, 2, 1), ("1f1b", 4, 2, 1)]
CONFIGS += [("zb_v", p, m, 2) for p, m in [(2, 3), (2, 4), (2, 5), (4, 7), (4, 8), (4, 12)]]
CONFIGS += [("dualpipe_v", p, m, 2) for p, m in [(2, 4), (2, 5), (3, 6), (4, 8), (4, 11)]]
CONFIGS += [("looped_bfs", p, m, v) for p, m, v in [(2, 2, 1), (2, 3, 2), (4, 4, 2), (4, 6, 3)]]


def _ids(config):
    return "{}-p{}-m{}-v{}".format(*config)


def _edit(tt: Timetable, **cells) -> Timetable:
    """A copy of ``tt`` with ``grid[tick][rank]`` replaced, cells given as ``t{tick}r{rank}=``."""
    grid = [list(row) for row in tt.grid]
    for key, action in cells.items():
        tick, rank = (int(x) for x in key[1:].split("r"))
        grid[tick][rank] = action
    return dataclasses.replace(tt, grid=grid)


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_schedule_is_valid_and_matches_theory(config):
    name, p, m, v = config
    tt = get_schedule(name, p, m, v)
    check_timetable(tt)
    assert (tt.name, tt.num_stages, tt.num_microbatches, tt.num_chunks) == (name, p, m, v)
    assert tt.split_backward == (name.startswith("zb") or name == "dualpipe_v")
    assert tt.num_ticks == theory_ticks(name, p, m, v)
    assert tt.bubble_fraction == pytest.approx(theory_bubble_fraction(name, p, m, v))
    per_rank = (3 if tt.split_backward else 2) * m * v
    assert [len(tt.actions_of(r)) for r in range(p)] == [per_rank] * p
    assert peak_in_flight(tt) == default_in_flight_limits(tt)


@pytest.mark.parametrize("p", [2, 4])
def test_one_f_one_b_in_flight_is_p_minus_stage_for_any_m(p):
    for m in (p, 2 * p, 3 * p + 1, 8 * p):
        assert peak_in_flight(one_f_one_b(p, m)) == [p - s for s in range(p)]


def test_gpipe_in_flight_is_m():
    for m in (2, 5, 8):
        assert peak_in_flight(gpipe(4, m)) == [m] * 4


@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 6), (4, 16)])
def test_zero_bubble_h1_is_a_third_of_one_f_one_b_bubble(p, m):
    zb, ofob = zero_bubble_h1(p, m), one_f_one_b(p, m)
    # With F = B = W = 1, 1F1B's whole backward takes 2 ticks, so each rank idles
    # 3 (p - 1) ticks; ZB-H1 idles p - 1, a third of it, in 3m + p - 1 ticks in all.
    assert [ofob.idle_ticks(r) for r in range(p)] == [2 * (p - 1)] * p
    assert [zb.idle_ticks(r) for r in range(p)] == [p - 1] * p
    assert zb.num_ticks == 3 * m + p - 1
    # Same activation memory as 1F1B: F..B exactly 1F1B's; F..W never above 1F1B's peak p.
    assert peak_in_flight(zb, until="B") == peak_in_flight(ofob)
    assert max(peak_in_flight(zb)) == max(peak_in_flight(ofob)) == p


@pytest.mark.parametrize("p", [2, 4])
def test_zero_bubble_v_layout_and_order_follow_torch(p):
    m = 2 * p
    tt = zero_bubble_v(p, m)
    assert tt.layout == "v" and tt.num_chunks == 2
    assert [tt.stage_of(r, c) for c in (0, 1) for r in range(p)] == (
        list(range(p)) + list(range(2 * p - 1, p - 1, -1))
    )
    assert all(tt.place_of(tt.stage_of(r, c)) == (r, c) for r in range(p) for c in (0, 1))
    # Rank p-1 turns the V: its chunk 0 forward feeds its own chunk 1 in the next tick.
    last = [a for _, a in tt.actions_of(p - 1)]
    assert last[:2] == [Action("F", 0, 0), Action("F", 0, 1)]
    # Rank 0 holds the last model stage, so it runs the first backward of chunk 1.
    rank0 = [a for _, a in tt.actions_of(0)]
    assert rank0[: 2 * p - 1] == [Action("F", i, 0) for i in range(2 * p - 1)]
    assert rank0[2 * p - 1 : 2 * p + 2] == [Action("F", 0, 1), Action("B", 0, 1), Action("W", 0, 1)]
    # Each rank idles p - 1 half-stage ticks, against ZB-H1's p - 1 full-stage ticks.
    assert [tt.idle_ticks(r) for r in range(p)] == [p - 1] * p
    assert max(peak_in_flight(tt)) == 2 * p  # chunk activations: 1F1B's p stages


@pytest.mark.parametrize("p, m", [(2, 3), (2, 4), (4, 7), (4, 12)])
def test_zero_bubble_v_order_is_torchs_schedule(p, m):
    """Every rank's ZB-V action order and the V layout, against torch's own
    ``ScheduleZBVZeroBubble.pipeline_order`` (torch computes it in the constructor from the
    stages' sizes alone: stand-in stages with those attributes need no process group)."""
    import_or_skip("torch", "torch's ScheduleZBVZeroBubble is the reference for ZB-V's order")
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble as TorchZBV

    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}  # torch's I is B
    tt = zero_bubble_v(p, m)
    for rank in range(p):
        stages = [SimpleNamespace(group_size=p, group_rank=rank, num_stages=2 * p,
                                  stage_index=s, submod=None, is_first=s == 0,
                                  is_last=s == 2 * p - 1) for s in (rank, 2 * p - 1 - rank)]
        torch_schedule = TorchZBV(stages, m)
        assert torch_schedule.stage_index_to_group_rank == {
            tt.stage_of(r, c): r for r in range(p) for c in (0, 1)}
        want = [(kinds[a.computation_type.name], a.microbatch_index, a.stage_index)
                for a in torch_schedule.pipeline_order[rank] if a is not None]
        got = [(a.kind, a.microbatch, tt.stage_of(rank, a.chunk)) for _, a in tt.actions_of(rank)]
        assert got == want, rank


def _torch_stand_ins(p: int, rank: int, stage_indices) -> list:
    """Stand-in stages with the attributes torch's schedules read in their constructors
    (they compute ``pipeline_order`` from the stages' sizes alone: no process group)."""
    from types import SimpleNamespace

    return [SimpleNamespace(group_size=p, group_rank=rank, num_stages=len(stage_indices) * p,
                            stage_index=s, submod=None, is_first=s == 0,
                            is_last=s == len(stage_indices) * p - 1) for s in stage_indices]


def _torch_order(actions, split: bool = True) -> list[tuple[str, int, int]]:
    """torch's actions as ``(kind, microbatch, stage)``: its I is B, its full backward B then
    W when the timetable splits its backwards (else B), its overlapped pair its forward then
    its full backward (the order torch runs them)."""
    out = []
    for a in actions:
        if a is None:
            continue
        if a.computation_type.name == "OVERLAP_F_B":
            out += _torch_order(a.sub_actions)
        elif a.computation_type.name == "FULL_BACKWARD":
            out += [(k, a.microbatch_index, a.stage_index) for k in ("BW" if split else "B")]
        else:
            kind = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
            out.append((kind[a.computation_type.name], a.microbatch_index, a.stage_index))
    return out


@pytest.mark.parametrize("p, m", [(2, 4), (2, 7), (3, 6), (4, 8), (4, 11)])
def test_dualpipe_v_order_is_torchs_schedule(p, m):
    """Every rank's DualPipeV order (its overlapped pairs unfolded) and the V layout, against
    torch's own ``ScheduleDualPipeV.pipeline_order``."""
    import_or_skip("torch", "torch's ScheduleDualPipeV is the reference for DualPipeV's order")
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV as TorchDualPipeV

    tt = dualpipe_v(p, m)
    for rank in range(p):
        torch_schedule = TorchDualPipeV(_torch_stand_ins(p, rank, (rank, 2 * p - 1 - rank)), m)
        assert torch_schedule.stage_index_to_group_rank == {
            tt.stage_of(r, c): r for r in range(p) for c in (0, 1)}
        pipeline_order = torch_schedule.pipeline_order[rank]
        assert any(a is not None and a.computation_type.name == "OVERLAP_F_B"
                   for a in pipeline_order)
        got = [(a.kind, a.microbatch, tt.stage_of(rank, a.chunk)) for _, a in tt.actions_of(rank)]
        assert got == _torch_order(pipeline_order), rank


@pytest.mark.parametrize("p, m, v", [(2, 3, 2), (4, 4, 2), (2, 2, 3), (3, 2, 1)])
def test_looped_bfs_order_is_torchs_schedule(p, m, v):
    """Every rank's looped-BFS order and loop layout, against torch's own
    ``ScheduleLoopedBFS.pipeline_order``."""
    import_or_skip("torch", "torch's ScheduleLoopedBFS is the reference for its order")
    from torch.distributed.pipelining.schedules import ScheduleLoopedBFS as TorchLoopedBFS

    tt = looped_bfs(p, m, v)
    for rank in range(p):
        stages = _torch_stand_ins(p, rank, range(rank, p * v, p))
        torch_schedule = TorchLoopedBFS(stages, m)
        got = [(a.kind, a.microbatch, tt.stage_of(rank, a.chunk)) for _, a in tt.actions_of(rank)]
        assert got == _torch_order(torch_schedule.pipeline_order[rank], split=False), rank


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 13), (8, 16)])
def test_dualpipe_v_bubble_is_deepseeks_formula(p, m):
    """At unit costs each rank idles DeepSeek-V3's (PP / 2 - 1)(F&B + B - 3W) with PP = 2p
    model stages and F&B = F + B + W, p - 1: under 1F1B's (p - 1)(F + B) on the same p ranks
    and a third of it, as ZB-H1's (p - 1)(F + B - W), with half-stage actions."""
    tt = dualpipe_v(p, m)
    unit = ActionCosts(1.0, 1.0, 1.0)
    assert paper_bubble(tt, unit) == (p - 1) * (3 + 1 - 3)
    assert check_bubble(tt, unit) == [p - 1] * p
    assert [tt.idle_ticks(r) for r in range(p)] == [p - 1] * p
    assert check_bubble(one_f_one_b(p, m)) == [(p - 1) * (1 + 2)] * p
    assert check_bubble(zero_bubble_h1(p, m)) == [p - 1] * p
    # heavier backwards: at most the formula's (p - 1)(F + B + W + B - 3W)
    heavy = ActionCosts(1.0, 2.0, 1.0)
    assert max(check_bubble(tt, heavy)) <= paper_bubble(tt, heavy) == (p - 1) * 3


def test_check_bubble_names_a_rank_over_the_formula():
    """GPipe's order on the V (every forward, then every backward) idles more than the
    formula: the checker names the first rank over it."""
    from jaxpg.pipeline.schedule._simulate import simulate

    order = [Action("F", i, c) for c in (0, 1) for i in range(4)]
    order += [Action(k, i, c) for c in (1, 0) for i in range(4) for k in "BW"]
    tt = simulate("dualpipe_v", [order] * 2, num_microbatches=4, num_chunks=2,
                  split_backward=True, layout="v")
    check_timetable(tt, max_in_flight=8)
    with pytest.raises(ValueError, match=r"'dualpipe_v' idles 4 on rank 0 .* bubble of 1\."):
        check_bubble(tt, ActionCosts(1.0, 1.0, 1.0))


def test_interleaving_shrinks_the_bubble():
    one = one_f_one_b(4, 8).bubble_fraction
    two = interleaved_1f1b(4, 8, 2).bubble_fraction
    four = interleaved_1f1b(4, 8, 4).bubble_fraction
    assert one > two > four
    assert two == pytest.approx(3 / 19)


def test_interleaved_layout_puts_chunk_c_on_stage_c_p_plus_rank():
    tt = interleaved_1f1b(4, 4, 2)
    arrays = tt.as_arrays()
    busy = arrays["kind"] != 0
    ranks = np.broadcast_to(np.arange(4), busy.shape)
    np.testing.assert_array_equal(arrays["stage"][busy], (arrays["chunk"] * 4 + ranks)[busy])
    # Rank 0 starts with microbatches 0..3 on chunk 0, then the same ones on chunk 1.
    assert [a for _, a in tt.actions_of(0)[:8]] == [
        Action("F", i, c) for c in (0, 1) for i in range(4)
    ]


def test_as_arrays_round_trips_the_grid():
    tt = zero_bubble_h1(4, 6)
    arrays = tt.as_arrays()
    assert set(arrays) == {"kind", "microbatch", "chunk", "stage"}
    for key, array in arrays.items():
        assert array.shape == (tt.num_ticks, 4) and array.dtype == np.int32, key
    names = {code: kind for kind, code in KIND_CODES.items()}
    for t, row in enumerate(tt.grid):
        for r, action in enumerate(row):
            kind = names[int(arrays["kind"][t, r])]
            if action is None:
                assert kind is None and arrays["microbatch"][t, r] == 0
            else:
                assert (
                    Action(kind, int(arrays["microbatch"][t, r]), int(arrays["chunk"][t, r]))
                    == action
                )


def test_to_text_draws_the_grid():
    text = one_f_one_b(2, 2).to_text()
    assert text.splitlines() == [
        "1f1b: p=2 m=2 v=1, 6 ticks, bubble 33.3%",
        "tick   | 0  1  2  3  4  5",
        "rank 0 | F0 F1 .  B0 .  B1",
        "rank 1 | .  F0 B0 F1 B1 .",
    ]
    assert "F3b" in interleaved_1f1b(4, 4, 2).to_text()
    assert "W5" in str(zero_bubble_h1(4, 6))


# ---------------------------------------------------------------- the checker rejects


def test_checker_rejects_an_action_before_its_input():
    tt = one_f_one_b(2, 2)  # rank 1: . F0 B0 F1 B1 .
    swapped = _edit(tt, t1r1=Action("B", 0), t2r1=Action("F", 0))
    with pytest.raises(
        ValueError,
        match=r"B of microbatch 0 on stage 1 \(rank 1\) at tick 1.*"
        r"needs F of microbatch 0 on stage 1 \(rank 1\), which runs at tick 2",
    ):
        check_timetable(swapped)


def test_checker_rejects_a_send_received_in_the_same_tick():
    tt = gpipe(2, 1)  # rank 0: F0 . . B0 ; rank 1: . F0 B0 .
    same_tick = _edit(tt, t1r1=None, t0r1=Action("F", 0))
    with pytest.raises(ValueError, match="needs F of microbatch 0 on stage 0.*strictly earlier"):
        check_timetable(same_tick)


def test_checker_rejects_w_before_b():
    tt = zero_bubble_h1(2, 2)
    rank1 = [(t, a) for t, a in tt.actions_of(1)]
    (tb, b0), (tw, w0) = rank1[1], next((t, a) for t, a in rank1 if a.kind == "W")
    assert b0 == Action("B", 0) and w0 == Action("W", 0)
    broken = _edit(tt, **{f"t{tb}r1": w0, f"t{tw}r1": b0})
    with pytest.raises(ValueError, match="runs W of microbatch 0 on stage 1"):
        check_timetable(broken)


def test_checker_rejects_a_missing_action():
    tt = one_f_one_b(4, 4)
    tick, action = tt.actions_of(2)[-1]
    with pytest.raises(ValueError, match=r"never runs B of microbatch 3 on stage 2 \(rank 2\)"):
        check_timetable(_edit(tt, **{f"t{tick}r2": None}))


def test_checker_rejects_a_duplicated_action():
    tt = gpipe(2, 2)  # rank 0: F0 F1 . . B0 B1
    with pytest.raises(
        ValueError, match="runs F of microbatch 0 on stage 0.*twice, at ticks 0 and 2"
    ):
        check_timetable(_edit(tt, t2r0=Action("F", 0)))


def test_checker_names_the_chunk_when_interleaved():
    tt = interleaved_1f1b(2, 2, 2)
    tick, _ = tt.actions_of(1)[0]
    with pytest.raises(
        ValueError, match=r"never runs F of microbatch 0 on stage 1 \(rank 1, chunk 0\)"
    ):
        check_timetable(_edit(tt, **{f"t{tick}r1": None}))


def test_checker_rejects_too_many_activations_in_flight():
    gpipe_as_1f1b = dataclasses.replace(gpipe(4, 8), name="1f1b")
    with pytest.raises(
        ValueError,
        match="keeps 5 activations in flight .* on rank 0 after tick 4, over its limit of 4",
    ):
        check_timetable(gpipe_as_1f1b)
    with pytest.raises(ValueError, match="keeps 3 activations .* rank 0 .* limit of 2"):
        check_timetable(one_f_one_b(4, 8), max_in_flight=2)
    with pytest.raises(ValueError, match="max_in_flight has 2 entries"):
        check_timetable(one_f_one_b(4, 8), max_in_flight=[4, 3])
    check_timetable(gpipe(4, 8), max_in_flight=[8, 8, 8, 8])
    check_timetable(dataclasses.replace(gpipe(4, 8), name="custom"))  # unknown: no bound


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: gpipe(4, 0), "gpipe needs a positive integer number of microbatches, got m=0"),
        (lambda: one_f_one_b(0, 4), "pipeline stages, got p=0"),
        (lambda: one_f_one_b(-2, 4), "got p=-2"),
        (lambda: gpipe(2, 2.0), "got m=2.0"),
        (lambda: zero_bubble_h1(4, 3), r"m=3 < p=4; use m >= 4"),
        (lambda: interleaved_1f1b(4, 8, 1), "v >= 2 model chunks per rank, got v=1"),
        (lambda: interleaved_1f1b(4, 6, 2), r"m=6 to be a multiple of .* p=4; use m=4 or m=8"),
        (lambda: interleaved_1f1b(4, 2, 2), r"m=2 to be a multiple of .* p=4; use m=4\."),
        (lambda: get_schedule("pipedream", 4, 8), "Unknown schedule name='pipedream'"),
        (lambda: get_schedule("1f1b", 4, 8, v=2), "one model chunk per rank, got v=2"),
        (lambda: get_schedule("zb_v", 4, 8, v=3), "exactly two chunks per rank, got v=3"),
        (lambda: zero_bubble_v(4, 0), "got m=0"),
        (lambda: dualpipe_v(4, 7), r"model stages \(2 p = 8\).* got m=7 with p=4; use m >= 8"),
        (lambda: get_schedule("dualpipe_v", 2, 4, v=3), "exactly two chunks per rank, got v=3"),
        (lambda: looped_bfs(2, 4, 0), "v >= 1 model chunks per rank, got v=0"),
        (lambda: check_bubble(gpipe(2, 2)), "no bubble formula for schedule 'gpipe'"),
        (lambda: peak_in_flight(gpipe(2, 2), until="W"), "until='W' must be 'B'"),
    ],
)
def test_bad_configs_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_registry_knows_the_seven_schedules():
    assert available_schedules() == (
        "gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v", "dualpipe_v", "looped_bfs")
    assert get_schedule("looped_bfs", 2, 3, v=2) == looped_bfs(2, 3, 2)
    assert get_schedule("zb_h1", 2, 2) == zero_bubble_h1(2, 2)


@pytest.mark.parametrize(
    "grid, error, match",
    [
        ([[None]], ValueError, r"grid\[0\] has 1 entries but num_stages=2"),
        ([[("F", 0, 0), None]], TypeError, "must be an Action or None"),
        ([[Action("W", 0), None]], ValueError, "W needs split_backward=True"),
        ([[Action("X", 0), None]], ValueError, "kind not in"),
        ([[Action("F", 2), None]], ValueError, r"microbatch outside 0..1 \(num_microbatches=2\)"),
        ([[Action("F", 0, 1), None]], ValueError, r"chunk outside 0..0 \(num_chunks=1\)"),
    ],
)
def test_timetable_validates_its_grid(grid, error, match):
    with pytest.raises(error, match=match):
        Timetable(
            "t", num_stages=2, num_microbatches=2, num_chunks=1, split_backward=False, grid=grid
        )


def test_timetable_validates_its_layout():
    with pytest.raises(ValueError, match="layout='w' must be one of"):
        Timetable("t", 2, 2, 2, False, (), layout="w")
    with pytest.raises(ValueError, match="layout='v' needs num_chunks=2, got num_chunks=1"):
        Timetable("t", 2, 2, 1, False, (), layout="v")


def test_timetable_validates_its_sizes():
    with pytest.raises(ValueError, match="num_stages=0 must be a positive integer"):
        Timetable("t", 0, 2, 1, False, ())
    with pytest.raises(TypeError, match="split_backward=1 must be True or False"):
        Timetable("t", 1, 2, 1, 1, ())
    with pytest.raises(ValueError, match="rank=5 must be in 0..1"):
        gpipe(2, 2).actions_of(5)


def test_no_import_cycles_in_the_pipeline_package():
    import ast
    import pathlib

    import jaxpg.pipeline as pkg

    root = pathlib.Path(pkg.__file__).parent

    def dotted(path):  # schedule/timetable.py -> "schedule.timetable"
        return ".".join(path.relative_to(root).with_suffix("").parts)

    modules = {dotted(path) for path in root.rglob("*.py") if path.stem != "__init__"}
    imports = {}
    for path in root.rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxpg.pipe"):
                module = node.module.removeprefix("jaxpg.pipeline").lstrip(".")
                names.update([module] if module else [a.name for a in node.names])
                names.update(f"{module}.{a.name}" for a in node.names)
        imports[dotted(path)] = {n for n in names if n in modules}
    imports = {name: targets for name, targets in imports.items()
               if not name.endswith("__init__")}

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n)))
                   for n in imports.get(start, ()))

    cycles = [name for name in imports if reaches(name, name)]
    assert not cycles, f"modules on an import cycle: {cycles}"
    assert len(imports) > 30 and imports["process.executor"]  # the folders are read
    assert "schedule.render" not in imports["schedule.timetable"]


@pytest.mark.parametrize("module", ["schedule.timetable", "schedule.builders", "schedule.checker",
                                    "schedule.render", "schedule.costs"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(f"jaxpg.pipeline.{module}"))
    assert result.attempted > 0 and result.failed == 0
