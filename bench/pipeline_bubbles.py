"""Pipeline bubbles: measured from the timetables against the papers' formulas.

For every schedule and a range of (p, m, v) this builds the timetable, checks
it, and records its ticks, its measured bubble fraction (idle rank-ticks over
all rank-ticks, one tick per action) and the formula's, plus the peak number
of activations in flight per rank. It writes
``bench/results/pipeline_bubbles.json`` and a picture of each schedule at
p=4, m=8 (v=2 for the interleaved one) as ``bench/results/schedule_<name>.png``.

Run:
    python bench/pipeline_bubbles.py
"""

from __future__ import annotations

import json
import pathlib

from jaxpg.pipeline.checker import check_timetable, peak_in_flight
from jaxpg.pipeline.render import render_png
from jaxpg.pipeline.schedules import get_schedule, theory_bubble_fraction, theory_ticks

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


def measure(name: str, p: int, m: int, v: int) -> dict:
    """One row of results for one schedule and size."""
    tt = get_schedule(name, p, m, v)
    check_timetable(tt)
    return {
        "schedule": name,
        "p": p,
        "m": m,
        "v": v,
        "ticks": tt.num_ticks,
        "theory_ticks": theory_ticks(name, p, m, v),
        "bubble": round(tt.bubble_fraction, 6),
        "theory_bubble": round(theory_bubble_fraction(name, p, m, v), 6),
        "peak_in_flight": peak_in_flight(tt),
    }


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = [measure(*config) for config in configs()]
    header = f"{'schedule':<17} {'p':>2} {'m':>3} {'v':>2} {'ticks':>6} {'theory':>6} "
    header += f"{'bubble':>8} {'theory':>8}  peak in flight per rank"
    print(header)
    for r in rows:
        print(
            f"{r['schedule']:<17} {r['p']:>2} {r['m']:>3} {r['v']:>2} {r['ticks']:>6} "
            f"{r['theory_ticks']:>6} {r['bubble']:>8.4f} {r['theory_bubble']:>8.4f}  "
            f"{r['peak_in_flight']}"
        )
    mismatches = [r for r in rows if r["ticks"] != r["theory_ticks"]]
    print(f"{len(rows)} timetables checked; {len(mismatches)} differ from the formulas.")
    out = RESULTS / "pipeline_bubbles.json"
    unit = "idle rank-ticks / total rank-ticks; every F, B, W (or chunk F, B) is one tick"
    out.write_text(json.dumps({"unit": unit, "results": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)):
        png = RESULTS / f"schedule_{name}.png"
        render_png(get_schedule(name, 4, 8, v), png)
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
