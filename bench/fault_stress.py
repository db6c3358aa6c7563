"""Repeats the fault-injection cases under ``jaxpg-run --max-restarts`` and counts outcomes.

Each run trains tests/multiprocess/workers/elastic_ddp.py on 2 workers with one injected
fault, with or without two busy-loop processes loading the CPU. A run is *good* when the
launcher exits 0, names the lost rank, no process aborted in C++ (JAX's "Terminating
process" fatal error, a check-failure stack trace) and the final parameters equal those of
an uninterrupted run. Writes bench/results/fault_stress.json::

    python bench/fault_stress.py --runs 20
    python bench/fault_stress.py --runs 3 --coordinator rank0   # baseline: rank 0 hosts it
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "multiprocess" / "workers" / "elastic_ddp.py"
STEPS = 6
CASES = {  # fault -> a pattern of the words that name the lost rank
    "killbefore:0:2": r"rank 0 exited with code -9",
    "killduring:0:2": r"rank 0 exited with code -9",
    "ckpt:0:3": r"rank 0 exited with code -9",
    "raise:1:2": r"rank 1 (exited )?with code 1",  # or listed after its peer's failure
    "stop:0:3": r"ranks that did not arrive: \[0\]",
}
CPP_ABORTS = ("Terminating process because", "Check failure stack trace", "terminate called")


def run(tmp: Path, fault: str, restarts: int,
        coordinator: str = "launcher") -> tuple[subprocess.CompletedProcess, dict, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", FAULT_GROUP_TIMEOUT="6", PYTHONPATH=str(ROOT))
    out = tmp / "params.npz"
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "jaxpg.run", "--nproc-per-node", "2", "--max-restarts",
         str(restarts), "--grace-period", "2", "--coordinator", coordinator, str(WORKER),
         str(tmp / "ckpt"), str(out), str(STEPS), fault],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    seconds = time.monotonic() - start
    params = dict(np.load(out)) if out.exists() else {}
    return result, params, seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=20, help="runs per case and load setting")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--coordinator", default="launcher", choices=("launcher", "rank0"),
                   help="rank0: the baseline, rank 0's worker hosts the service")
    p.add_argument("--loads", default="0,1", help="0 without load, 1 with two busy loops")
    p.add_argument("--tag", default="", help="suffix of the result file name")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        _, reference, _ = run(Path(d), "none", 0)
    rows = []
    for load in [bool(int(x)) for x in args.loads.split(",")]:
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(2 * load)]
        try:
            for fault in args.cases.split(","):
                good, seconds, failures = 0, [], []
                for i in range(args.runs):
                    with tempfile.TemporaryDirectory() as d:
                        result, params, s = run(Path(d), fault, 2, args.coordinator)
                    text = result.stdout + result.stderr
                    checks = {
                        "exit 0": result.returncode == 0,
                        "named": re.search(CASES[fault], text) is not None,
                        "no C++ abort": not any(a in text for a in CPP_ABORTS),
                        "identical": params.keys() == reference.keys() and all(
                            np.array_equal(params[k], reference[k]) for k in reference),
                    }
                    seconds.append(s)
                    if all(checks.values()):
                        good += 1
                    else:
                        failed = [k for k, v in checks.items() if not v]
                        failures.append({"run": i, "failed": failed,
                                         "tail": re.sub(r"\s+", " ", text[-600:])})
                    print(f"load={load} {fault} run {i}: {checks}", flush=True)
                rows.append({"fault": fault, "load": load, "coordinator": args.coordinator,
                             "runs": args.runs, "good": good,
                             "median_s": float(np.median(seconds)), "failures": failures})
        finally:
            for s in spinners:
                s.kill()
                s.wait()
    suffix = ("" if args.coordinator == "launcher" else f"_{args.coordinator}") + args.tag
    out = ROOT / "bench" / "results" / f"fault_stress{suffix}.json"
    out.write_text(json.dumps({"machine": "2 shared CPU cores (other benchmarks running)",
                               "steps": STEPS, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
