"""One results file per suite: ``bench/results/<suite>.json``, its configurations inside.

A suite's file holds its latest default run at the top level (what ``bench/report.py`` and
the docs read) and, under ``"configurations"``, the latest run of each other configuration
the docs cite, by name (``throughput.json``'s ``configurations.n8``: the same suite at
N = 8). ``save`` writes one run into the file and keeps the rest; ``load`` reads one back.
Earlier runs are in git's history. No torch or JAX import.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIGURATIONS = "configurations"


def save(path: str | Path, result: dict, configuration: str | None = None) -> Path:
    """Writes ``result`` into ``path``: as the default run (``configuration=None``; the
    file's configurations are kept) or as the configuration of that name (the default run
    and the other configurations are kept)."""
    path = Path(path)
    if CONFIGURATIONS in result:
        raise ValueError(f"a result may not hold the key {CONFIGURATIONS!r}: it names the "
                         f"file's configurations ({path}).")
    old = json.loads(path.read_text()) if path.exists() else {}
    configurations = old.get(CONFIGURATIONS, {})
    if configuration is None:
        data = {**result, CONFIGURATIONS: configurations} if configurations else dict(result)
    else:
        if not configuration or configuration.startswith("_"):
            raise ValueError(f"configuration={configuration!r}: give a name such as 'n8' "
                             f"(no leading '_').")
        configurations = {**configurations, configuration: result}
        data = {**{k: v for k, v in old.items() if k != CONFIGURATIONS},
                CONFIGURATIONS: configurations}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def load(path: str | Path, configuration: str | None = None) -> dict:
    """The default run of ``path`` (without its configurations), or the named one."""
    data = json.loads(Path(path).read_text())
    if configuration is None:
        return {k: v for k, v in data.items() if k != CONFIGURATIONS}
    found = data.get(CONFIGURATIONS, {})
    if configuration not in found:
        raise SystemExit(f"{path}: no configuration {configuration!r}; it has "
                         f"{', '.join(found) or 'none'}.")
    return found[configuration]


def add_flag(parser) -> None:
    """The suites' ``--configuration NAME`` flag."""
    parser.add_argument("--configuration", default=None, metavar="NAME",
                        help="write the run into --out's file as this named configuration "
                             "(default: as the file's default run; bench/_results.py)")
