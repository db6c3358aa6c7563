"""The benchmarks' front door: ``python -m bench SUITE [--quick] [ARGS ...]``.

A suite is a top-level script of ``bench/`` whose name does not start with ``_``; a new
script is a suite without being listed anywhere. ``python -m bench --list`` prints each
suite with the first line of its docstring and what it accepts:

* ``--quick`` runs the suite's short form: its own ``--quick`` flag, or, for a suite
  without one, the arguments its module-level ``QUICK_ARGS`` list names; a quick run
  writes its results under ``$TMPDIR/jaxpg-bench-quick/``, not over ``bench/results/``
  (unless ``--out`` says otherwise);
* a suite that must run under the launcher names the launcher's arguments in
  ``LAUNCH_ARGS`` (``["--nproc-per-node", "2"]``), and runs as ``python -m jaxpg.run
  ARGS bench/SUITE.py ...``; every other suite runs as ``python bench/SUITE.py ...``,
  exactly as when started by hand.

Every other argument goes to the suite (``python -m bench SUITE --help`` prints its own).
The suites write ``bench/results/<suite>.json`` by default, one file per suite; a run of
another configuration goes inside it, under ``"configurations"`` (``--configuration NAME``,
bench/_results.py; bench/README.md).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
QUICK_RESULTS = Path(tempfile.gettempdir()) / "jaxpg-bench-quick"


@dataclass(frozen=True)
class Suite:
    """One top-level script of ``bench/``: its name, path and declared forms."""

    name: str
    path: Path
    summary: str
    has_quick_flag: bool
    quick_args: tuple[str, ...] | None
    launch_args: tuple[str, ...] | None
    default_out: str | None  # the file name under results/ its --out defaults to

    @property
    def quick(self) -> bool:
        """Whether ``--quick`` has a meaning for this suite."""
        return self.has_quick_flag or self.quick_args is not None


def _literal(tree: ast.Module, name: str, path: Path) -> tuple[str, ...] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets):
            value = ast.literal_eval(node.value)
            if not (isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)):
                raise ValueError(f"{path}: {name} must be a list of strings, got {value!r}.")
            return tuple(value)
    return None


def read_suite(path: Path) -> Suite:
    """Reads a suite's docstring and declarations without importing it (importing a
    suite may set JAX's device flags or start work)."""
    source = path.read_text()
    tree = ast.parse(source, str(path))
    doc = (ast.get_docstring(tree) or "").strip()
    summary = doc.split("\n\n")[0].replace("\n", " ")
    summary = summary.split(". ")[0].rstrip(".")
    if len(summary) > 96:
        summary = summary[:95].rsplit(" ", 1)[0] + " ..."
    out = re.search(r'add_argument\("--out", default=str\((?:RESULTS|OUT) / "([^"]+)"\)', source)
    return Suite(path.stem, path, summary, '"--quick"' in source,
                 _literal(tree, "QUICK_ARGS", path), _literal(tree, "LAUNCH_ARGS", path),
                 out.group(1) if out else None)


def suites() -> dict[str, Suite]:
    """Every suite, by name."""
    return {p.stem: read_suite(p) for p in sorted(BENCH.glob("*.py"))
            if not p.name.startswith("_")}


def command(suite: Suite, args: list[str]) -> list[str]:
    """The command line that runs ``suite`` with ``args``: ``--quick`` resolved, and a quick
    run's results written under ``QUICK_RESULTS`` (not over the stored ones) unless
    ``--out`` is given."""
    if "--quick" in args:
        if not suite.quick:
            raise SystemExit(
                f"python -m bench {suite.name} --quick: this suite has no quick form (no "
                f"--quick flag, no QUICK_ARGS); run it with its own arguments "
                f"(python -m bench {suite.name} --help).")
        if not suite.has_quick_flag:
            args = [a for a in args if a != "--quick"] + list(suite.quick_args or ())
        if suite.default_out and not any(a == "--out" or a.startswith("--out=") for a in args):
            args = [*args, "--out", str(QUICK_RESULTS / suite.default_out)]
    script = [str(suite.path), *args]
    if suite.launch_args is not None:
        return [sys.executable, "-m", "jaxpg.run", *suite.launch_args, *script]
    return [sys.executable, *script]


def _print_list(found: dict[str, Suite]) -> None:
    width = max(len(n) for n in found)
    for name, suite in found.items():
        marks = [m for m, on in (("quick", suite.quick), ("launched", suite.launch_args))
                 if on]
        tag = f" [{', '.join(marks)}]" if marks else ""
        print(f"{name:<{width}}  {suite.summary}{tag}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    found = suites()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().split("\n\n")[0])
        print("\nusage: python -m bench --list | python -m bench SUITE [--quick] [ARGS ...]")
        return 0
    if argv[0] == "--list":
        _print_list(found)
        return 0
    name, args = argv[0], argv[1:]
    if name not in found:
        raise SystemExit(f"python -m bench: no suite {name!r}; the suites are "
                         f"{', '.join(found)} (python -m bench --list).")
    env = dict(os.environ)
    root = str(BENCH.parent)  # the checkout, for `import jaxpg` from a source tree
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    QUICK_RESULTS.mkdir(exist_ok=True)
    return subprocess.call(command(found[name], args), env=env)


if __name__ == "__main__":
    sys.exit(main())
