"""Pictures of timetables: the text grid and the PNG."""

from __future__ import annotations

import sys

import pytest

from jaxpg.pipeline.schedule.builders import get_schedule
from jaxpg.pipeline.schedule.render import render_png, render_text

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "name, v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zb_v", 2)]
)
def test_render_png_writes_a_png(tmp_path, name, v):
    path = tmp_path / f"{name}.png"
    render_png(get_schedule(name, 4, 8, v), path)
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 2000


def test_render_png_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        render_png(get_schedule("1f1b", 2, 2), tmp_path / "x.png")


def test_render_text_has_one_line_per_rank_and_a_column_per_tick():
    tt = get_schedule("zb_h1", 4, 12)
    lines = render_text(tt, header=False).splitlines()
    assert len(lines) == 4
    assert all(line.startswith(f"rank {r} | ") for r, line in enumerate(lines))
    # Labels up to "F11" are 3 wide; every cell is padded to that width.
    cells = render_text(tt).splitlines()[1].split(" | ")[1].split()
    assert cells == [str(t) for t in range(tt.num_ticks)]
    assert tt.to_text() == render_text(tt)
