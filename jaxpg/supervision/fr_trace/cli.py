"""The ``jaxpg-fr-trace`` command line (torch's ``torchfrtrace``, for jaxpg's dumps).

    jaxpg-fr-trace DIR [--prefix jaxpg_fr_rank_] [--json]
    jaxpg-fr-trace FILE [FILE ...]

Exit status: 0 when the dumps show no problem, 1 when the verdict names one, 2 when no
dump could be read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from jaxpg.supervision.fr_dump import DEFAULT_NAME
from jaxpg.supervision.fr_trace.analysis import analyze, load_dumps

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxpg-fr-trace",
        description="Merge jaxpg flight-recorder dumps (one per process: JAXPG_FR_DUMP_DIR) "
                    "and name the rank at fault: the first call where ranks disagree, the "
                    "ranks that never arrived, or the ranks with no dump.")
    parser.add_argument("paths", nargs="+", metavar="DIR",
                        help="a directory of dumps, or dump files")
    parser.add_argument("-p", "--prefix", default=DEFAULT_NAME,
                        help=f"file-name prefix of the dumps in a directory (default "
                             f"{DEFAULT_NAME!r}; torch's TORCH_FR_DUMP_TEMP_FILE's last part)")
    parser.add_argument("-j", "--json", action="store_true",
                        help="print the verdict as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the analyzer; returns the exit status (see the module docstring)."""
    args = _parser().parse_args(argv)
    procs, problems = load_dumps(list(args.paths), args.prefix)
    if not procs:
        print(f"jaxpg-fr-trace: no jaxpg flight-recorder dump in {' '.join(args.paths)} "
              f"(files named {args.prefix}*). Set JAXPG_FR_BUFFER_SIZE and JAXPG_FR_DUMP_DIR "
              "in the job, or pass --prefix." + "".join(f"\n  {p}" for p in problems),
              file=sys.stderr)
        return 2
    verdict = analyze(procs)
    verdict["problems"] = problems
    try:
        _print(verdict, procs, problems, args.json)
    except BrokenPipeError:  # | head: the reader had enough (and no error at exit's flush)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if verdict["verdict"] == "no problem found" else 1


def _print(verdict: dict, procs: list, problems: list[str], as_json: bool) -> None:
    if as_json:
        print(json.dumps(verdict, indent=2, default=str))
    else:
        ranks = sorted(r for p in procs for r in p.ranks)
        print(f"jaxpg-fr-trace: {len(procs)} dumps (ranks {', '.join(map(str, ranks))})")
        print(verdict["text"])
        for problem in problems:
            print(f"note: {problem}")
