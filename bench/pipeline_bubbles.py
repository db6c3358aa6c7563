"""Pipeline bubbles: measured from the timetables against the papers' formulas.

For every schedule and a range of (p, m, v) this builds the timetable, checks
it, and records its ticks, its measured bubble fraction (idle rank-ticks over
all rank-ticks, one tick per action) and the formula's, the peak number of
activations in flight per rank, and the cost-weighted figures
(``jaxpg.pipeline.schedule.costs``, default costs F:B:W 1:1:1 with a split backward and
F:B 1:2 without): the event-driven time and bubble in those units, and the
lockstep executor's time (a tick lasts as long as its slowest action). It
writes ``bench/results/pipeline_bubbles.json``, a picture of each schedule at
p=4, m=8 (v=2 for the interleaved one) as ``bench/results/schedule_<name>.png``
and the same drawn by cost as ``schedule_<name>_costs.png``.

Run:
    python bench/pipeline_bubbles.py
"""

from __future__ import annotations

import json
import pathlib

from jaxpg.pipeline.schedule.builders import (
    get_schedule,
    one_f_one_b,
    theory_bubble_fraction,
    theory_ticks,
)
from jaxpg.pipeline.schedule.checker import check_timetable, peak_in_flight
from jaxpg.pipeline.schedule.costs import default_costs, lockstep_time, timed
from jaxpg.pipeline.schedule.render import render_png

RESULTS = pathlib.Path(__file__).parent / "results"


def configs():
    """(name, p, m, v) for every run; m a multiple of p so every schedule applies."""
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p, 8 * p):
            yield ("gpipe", p, m, 1)
            yield ("1f1b", p, m, 1)
            for v in (2, 4):
                yield ("interleaved_1f1b", p, m, v)
            yield ("zb_h1", p, m, 1)
            yield ("zb_v", p, m, 2)
            yield ("1f1b_split", p, m, 1)


def build(name: str, p: int, m: int, v: int):
    if name == "1f1b_split":
        return one_f_one_b(p, m, split_backward=True)
    return get_schedule(name, p, m, v)


def measure(name: str, p: int, m: int, v: int) -> dict:
    """One row of results for one schedule and size."""
    tt = build(name, p, m, v)
    check_timetable(tt)
    costs = default_costs(tt)
    replay = timed(tt, costs)
    split = name == "1f1b_split"
    theory = 3 * m + 2 * (p - 1) if split else theory_ticks(name, p, m, v)
    return {
        "schedule": name,
        "p": p,
        "m": m,
        "v": v,
        "ticks": tt.num_ticks,
        "theory_ticks": theory,
        "bubble": round(tt.bubble_fraction, 6),
        "theory_bubble": round(
            2 * (p - 1) / (3 * m + 2 * (p - 1)) if split else theory_bubble_fraction(name, p, m, v),
            6,
        ),
        "peak_in_flight": peak_in_flight(tt),
        "costs": list(costs),
        "time": replay.makespan,
        "bubble_in_costs": round(replay.bubble_fraction, 6),
        "lockstep_time": lockstep_time(tt, costs),
    }


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = [measure(*config) for config in configs()]
    header = f"{'schedule':<17} {'p':>2} {'m':>3} {'v':>2} {'ticks':>6} {'theory':>6} "
    header += f"{'bubble':>8} {'theory':>8} {'time':>6} {'bubble':>7} {'lockstep':>8}"
    header += "  peak in flight per rank"
    print(header)
    for r in rows:
        print(
            f"{r['schedule']:<17} {r['p']:>2} {r['m']:>3} {r['v']:>2} {r['ticks']:>6} "
            f"{r['theory_ticks']:>6} {r['bubble']:>8.4f} {r['theory_bubble']:>8.4f} "
            f"{r['time']:>6g} {r['bubble_in_costs']:>7.4f} {r['lockstep_time']:>8g}  "
            f"{r['peak_in_flight']}"
        )
    mismatches = [r for r in rows if r["ticks"] != r["theory_ticks"]]
    print(f"{len(rows)} timetables checked; {len(mismatches)} differ from the formulas.")
    out = RESULTS / "pipeline_bubbles.json"
    unit = "idle rank-ticks / total rank-ticks; every F, B, W (or chunk F, B) is one tick"
    cost_unit = (
        "time, bubble_in_costs, lockstep_time: with costs F:B:W (1:1:1 split, 1:2 whole "
        "backward; a chunk's action costs as much as a whole stage's in these units)"
    )
    out.write_text(
        json.dumps({"unit": unit, "cost_unit": cost_unit, "results": rows}, indent=1) + "\n"
    )
    print(f"wrote {out}")
    for name, v in (
        ("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zb_v", 2),
        ("1f1b_split", 1),
    ):  # fmt: skip
        tt = build(name, 4, 8, v)
        png = RESULTS / f"schedule_{name}.png"
        render_png(tt, png)
        render_png(tt, RESULTS / f"schedule_{name}_costs.png", costs=default_costs(tt))
        print(f"wrote {png} and its _costs.png")


# python -m bench pipeline_bubbles --quick: a short run, written under /tmp unless --out is given
QUICK_ARGS = []

if __name__ == "__main__":
    main()
