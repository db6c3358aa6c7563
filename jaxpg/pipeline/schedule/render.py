"""Pictures of a timetable: a text grid and a PNG, drawn as the papers draw them.

Rows are ranks, columns are ticks. Cells are ``F3`` (forward of microbatch
3), ``B3`` (backward, or input gradient when the backward is split) and
``W3`` (weight gradient); with several chunks per rank a letter names the
chunk (``F3a`` chunk 0, ``F3b`` chunk 1). Idle ticks are ``.`` in text and
white in the PNG.

Example:
    >>> from jaxpg.pipeline.schedule.builders import gpipe
    >>> print(render_text(gpipe(2, 2)))
    gpipe: p=2 m=2 v=1, 6 ticks, bubble 33.3%
    tick   | 0  1  2  3  4  5
    rank 0 | F0 F1 .  .  B0 B1
    rank 1 | .  F0 F1 B0 B1 .
"""

from __future__ import annotations

import os

from jaxpg.pipeline.schedule.costs import ActionCosts, lockstep_time, timed
from jaxpg.pipeline.schedule.timetable import Timetable, render_grid, timetable_title

__all__ = ["render_png", "render_text"]

# Per kind, one color per chunk (darker for chunk 0), cycled for more chunks.
_COLORS = {
    "F": ("#3b75af", "#8fb8de"),
    "B": ("#3a9e5f", "#98d4a8"),
    "W": ("#e08a2c", "#f4c48d"),
}
_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}


def render_text(tt: Timetable, header: bool = True) -> str:
    """The timetable as a fixed-width text grid, one line per rank (as ``tt.to_text``).

    Args:
      tt: The timetable.
      header: Whether to start with a title line and a line of tick numbers.

    Returns:
      The grid as a string, without a trailing newline.
    """
    return render_grid(tt, header=header)


def render_png(
    tt: Timetable,
    path: str | os.PathLike,
    *,
    dpi: int = 120,
    costs: ActionCosts | None = None,
) -> None:
    """Draw the timetable as colored boxes and save it as a PNG.

    F is blue, B green, W orange, idle white; each box shows its microbatch
    number. With several chunks per rank, chunk 0 is the darker shade.

    Args:
      tt: The timetable.
      path: Where to write the PNG.
      dpi: Resolution of the image.
      costs: If given, draw each action as wide as its cost, where it starts
        when the timetable is replayed event-driven (``jaxpg.pipeline.schedule.costs.timed``),
        and give the makespan, the bubble in cost units and the lockstep
        executor's time in the title. Default: one tick per action.

    Raises:
      ImportError: If matplotlib is not installed.
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch, Rectangle
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "render_png draws with matplotlib, which is not installed; "
            "run `pip install matplotlib` and try again."
        ) from err

    p = tt.num_stages
    title = timetable_title(tt)
    if costs is None:
        ticks = tt.num_ticks
        place = {(r, t): (float(t), 1.0) for t, row in enumerate(tt.grid) for r in range(p)}
    else:
        replay = timed(tt, costs)
        ticks = replay.makespan
        place = {
            (r, t): (begin, costs.of(tt.grid[t][r].kind)) for (r, t), begin in replay.start.items()
        }
        title = (
            f"{tt.name}: p={p} m={tt.num_microbatches} v={tt.num_chunks}, costs "
            f"F:B:W = {costs.F:g}:{costs.B:g}:{costs.W:g}, time {replay.makespan:g}, "
            f"bubble {replay.bubble_fraction:.1%}, lockstep {lockstep_time(tt, costs):g}"
        )
    cell = 0.32
    height = 1.3 + 0.45 * p
    fig = Figure(figsize=(max(6.0, 1.2 + cell * ticks), height))
    ax = fig.add_subplot()
    fontsize = 7 if tt.num_microbatches < 10 else 6
    if costs is not None:
        for r in range(p):  # idle is what no action covers
            ax.add_patch(Rectangle((0, r), ticks, 1, facecolor="white", edgecolor="#555555",
                                   lw=0.5))  # fmt: skip
    for t, row in enumerate(tt.grid):
        for r, action in enumerate(row):
            if action is None and costs is not None:
                continue
            x0, width = place[(r, t)]
            face = "white"
            if action is not None:
                shades = _COLORS[action.kind]
                face = shades[action.chunk % len(shades)]
            ax.add_patch(
                Rectangle((x0, r), width, 1, facecolor=face, edgecolor="#555555", lw=0.5)
            )
            if action is not None:
                color = "white" if action.chunk % 2 == 0 else "black"
                ax.text(
                    x0 + width / 2,
                    r + 0.5,
                    str(action.microbatch),
                    ha="center",
                    va="center",
                    fontsize=fontsize,
                    color=color,
                )
    ax.set_xlim(0, ticks)
    ax.set_ylim(p, 0)
    ax.set_yticks([r + 0.5 for r in range(p)], [f"rank {r}" for r in range(p)])
    step = max(1, int(ticks) // 20)
    if costs is None:
        ax.set_xticks(
            [t + 0.5 for t in range(0, ticks, step)], [str(t) for t in range(0, ticks, step)]
        )
        ax.set_xlabel("tick")
    else:
        marks = range(0, int(ticks) + 1, step)
        ax.set_xticks(list(marks), [str(t) for t in marks])
        ax.set_xlabel("time (cost units; one forward = 1)")
    ax.tick_params(length=0, labelsize=8)
    ax.set_title(title, fontsize=9)
    kinds = ("F", "B", "W") if tt.split_backward else ("F", "B")
    if tt.num_chunks == 1:
        shades = [""]
    elif tt.num_chunks == 2:
        shades = [" (chunk 0)", " (chunk 1)"]
    else:
        shades = [" (even chunks)", " (odd chunks)"]
    handles = [
        Patch(facecolor=_COLORS[k][c], edgecolor="#555555", label=_NAMES[k] + shade)
        for k in kinds
        for c, shade in enumerate(shades)
    ]
    handles.append(Patch(facecolor="white", edgecolor="#555555", label="idle"))
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.5 / (0.77 * height)),
        ncol=len(handles),
        fontsize=7,
        frameon=False,
    )
    fig.savefig(os.fspath(path), dpi=dpi, bbox_inches="tight")
