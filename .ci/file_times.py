#!/usr/bin/env python3
"""Prints the slowest test files of a pytest JUnit XML report: seconds per file (setup, call
and teardown of its tests), and the CPU seconds they used, this process's and its child
processes' (the ``cpu_s`` and ``children_cpu_s`` properties tests/conftest.py records), so
each CI leg's output can be read against the per-file budgets in docs/development.md. The
two legs share two cores, so CPU is what a file costs the run. Usage:
``.ci/file_times.py junit.xml [N]`` (default: 25 files, by wall time, then 15 by CPU).
Failed tests come last, each with its message and the end of its report, so that the tail of
a CI log names them."""

import collections
import sys
import xml.etree.ElementTree as ET


def main() -> None:
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25
    seconds: collections.Counter[str] = collections.Counter()
    cpu: collections.Counter[str] = collections.Counter()
    children: collections.Counter[str] = collections.Counter()
    tests: collections.Counter[str] = collections.Counter()
    failed: list[tuple[str, str, str]] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")  # tests.dir.test_file[.TestClass]
        module = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
        name = case.get("file") or "/".join(parts[:module + 1]) + ".py"
        seconds[name] += float(case.get("time", 0))
        tests[name] += 1
        props = {p.get("name"): float(p.get("value", 0)) for p in case.iter("property")}
        cpu[name] += props.get("cpu_s", 0.0)
        children[name] += props.get("children_cpu_s", 0.0)
        for bad in list(case.iter("failure")) + list(case.iter("error")):
            failed.append((f"{name}::{case.get('name')}", bad.get("message") or "",
                           bad.text or ""))
    total = sum(seconds.values())
    total_cpu = sum(cpu.values()) + sum(children.values())
    print(f"== slowest {top} test files ({total / 60:.1f} min in {len(seconds)} files; "
          f"{total_cpu / 60:.1f} CPU min: {sum(cpu.values()) / 60:.1f} in pytest, "
          f"{sum(children.values()) / 60:.1f} in child processes)")
    print("  wall s    CPU s (pytest + children)  tests  file")
    for name, s in seconds.most_common(top):
        print(f"{s:8.1f} {cpu[name] + children[name]:8.1f} ({cpu[name]:7.1f} + "
              f"{children[name]:7.1f})  {tests[name]:5d}  {name}")
    both = collections.Counter({n: cpu[n] + children[n] for n in seconds})
    print("== the 15 files that used most CPU")
    for name, c in both.most_common(15):
        print(f"{c:8.1f} CPU s ({cpu[name]:7.1f} + {children[name]:7.1f}), {seconds[name]:8.1f} "
              f"wall s  {name}")
    if failed:
        print(f"== {len(failed)} failed test(s)")
    for test, message, text in failed:
        print(f"FAILED {test}: {(message.splitlines() or [''])[0][:300]}")
        for line in text.strip().splitlines()[-12:]:
            print(f"    {line[:300]}")


if __name__ == "__main__":
    main()
