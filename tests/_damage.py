"""Damaging a saved checkpoint as a node lost in the middle of a write does: its array files
cut to half their size."""

import os


def cut_array_files(step_dir) -> list[str]:
    """Truncates every array data file of the checkpoint in ``step_dir`` (``<root>/<step>``:
    the files under ``state/**/d/``, which hold orbax's OCDBT index and the arrays' chunks)
    to half its size; returns their paths."""
    cut = []
    for folder, _, files in os.walk(os.path.join(step_dir, "state")):
        if os.path.basename(folder) != "d":
            continue
        for name in files:
            path = os.path.join(folder, name)
            os.truncate(path, os.path.getsize(path) // 2)
            cut.append(path)
    assert cut, f"no array files under {step_dir}"
    return cut
