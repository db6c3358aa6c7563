#!/usr/bin/env python3
"""Prints the slowest test files of a pytest JUnit XML report: seconds per file (setup, call
and teardown of its tests), so each CI leg's output can be read against the per-file budgets
in docs/development.md. Usage: ``.ci/file_times.py junit.xml [N]`` (default: 25 files)."""

import collections
import sys
import xml.etree.ElementTree as ET


def main() -> None:
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25
    seconds: collections.Counter[str] = collections.Counter()
    tests: collections.Counter[str] = collections.Counter()
    for case in ET.parse(path).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")  # tests.dir.test_file[.TestClass]
        module = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
        name = case.get("file") or "/".join(parts[:module + 1]) + ".py"
        seconds[name] += float(case.get("time", 0))
        tests[name] += 1
    total = sum(seconds.values())
    print(f"== slowest {top} test files ({total / 60:.1f} min in {len(seconds)} files)")
    for name, s in seconds.most_common(top):
        print(f"{s:8.1f} s {tests[name]:5d} tests  {name}")


if __name__ == "__main__":
    main()
