"""Repeats the fault-injection cases, under ``jaxpg-run`` and without it, and counts outcomes.

Each run trains tests/multiprocess/workers/elastic_ddp.py with one injected fault, with or
without two busy-loop processes loading the CPU, in one of two modes:

* ``launcher``: ``jaxpg-run --nproc-per-node 2 --max-restarts 2`` (the launcher hosts the
  coordination service). Good: the launcher exits 0, names the lost rank, no process
  aborted in C++ and the final parameters equal those of an uninterrupted run.
* ``nolauncher``: 3 plain processes (``init_process_group()`` from env://, rank 0 hosts the
  service, in its child process). Good: every survivor exits non-zero with a Python
  ``DistNetworkError``/``DistTimeoutError`` naming the lost rank, within the group timeout
  plus the heartbeat timeout of the fault (+ ``SLACK_S`` for the process to exit), no
  survivor aborted in C++, and rank 0's service child is gone within its linger. The lost
  rank's own output is counted apart (``lost_rank_cpp_aborts``): it is being killed.

The runs are interleaved (round after round over mode x load x case), and the results file
is rewritten after every run, so a stopped stress still leaves exact counts::

    python bench/fault_stress.py --runs 20
    python bench/fault_stress.py --modes launcher --runs 20 --configuration launcher
    python bench/fault_stress.py --runs 3 --modes nolauncher --loads 1
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _launch import RESULTS, ROOT, child_env, free_port, launch  # bench/ is sys.path[0]
from _results import add_flag, save
from _results import load as load_result

WORKER = ROOT / "tests" / "multiprocess" / "workers" / "elastic_ddp.py"
STEPS = 6
GROUP_TIMEOUT_S = 6
HEARTBEAT_S = 3
LINGER_S = 5
SLACK_S = 3.0  # a survivor's exit after its error (traceback, interpreter teardown)
CASES = {  # fault -> (the lost rank, a pattern of the launcher's words naming it)
    "killbefore:0:2": (0, r"rank 0 exited with code -9"),
    "killduring:0:2": (0, r"rank 0 exited with code -9"),
    "ckpt:0:3": (0, r"rank 0 exited with code -9"),
    "raise:1:2": (1, r"rank 1 (exited )?with code 1"),  # or listed after its peer's failure
    "stop:0:3": (0, r"ranks that did not arrive: \[0\]"),
}
CPP_ABORTS = ("Terminating process because", "Check failure stack trace", "terminate called",
              "exception not rethrown")


ENV = {"XLA_FLAGS": None, "FAULT_GROUP_TIMEOUT": str(GROUP_TIMEOUT_S),
       "JAXPG_HEARTBEAT_TIMEOUT": str(HEARTBEAT_S), "JAXPG_COORDINATOR_LINGER": str(LINGER_S)}


def run_launcher(tmp: Path, fault: str, restarts: int = 2,
                 coordinator: str = "launcher") -> tuple[dict, dict]:
    out = tmp / "params.npz"
    # the faults make runs fail on purpose: check=False, the outcome judged by the caller
    done = launch(WORKER, [tmp / "ckpt", out, STEPS, fault], nproc=2,
                  launcher_args=["--max-restarts", restarts, "--grace-period", "2",
                                 "--coordinator", coordinator],
                  env=ENV, timeout=600, check=False)
    params = dict(np.load(out)) if out.exists() else {}
    return {"rc": done.returncode, "text": done.output or "", "seconds": done.seconds}, params


def _service_children(port: int) -> list[int]:
    """Pids of coordination-service children serving ``port``
    (jaxpg.runtime.coordinator_process)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(b"coordinator_process.py" in c for c in cmd) and any(
                c.endswith(f":{port}".encode()) for c in cmd):
            found.append(int(entry.name))
    return found


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def run_plain(tmp: Path, fault: str, n: int = 3) -> dict:
    """``n`` processes without the launcher; returns what each did and when.

    Not bench/_launch.launch: the point is ranks started without jaxpg-run (each its own
    process, env://), watched one by one as they end; they get launch's environment."""
    port = free_port()
    env = child_env(ENV)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n),
               TORCHELASTIC_RESTART_COUNT="0")
    logs = [open(tmp / f"rank{r}.log", "w+") for r in range(n)]
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(tmp / "ckpt"),
                               str(tmp / "params.npz"), str(STEPS), fault],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=logs[r], stderr=subprocess.STDOUT)
             for r in range(n)]
    lost = CASES[fault][0]
    start = time.monotonic()
    ended: dict[int, float] = {}
    fault_at = None
    deadline = start + 300
    while len(ended) < n and time.monotonic() < deadline:
        now = time.monotonic()
        for r, p in enumerate(procs):
            if r not in ended and p.poll() is not None:
                ended[r] = now
        if fault_at is None and (lost in ended or _stopped(procs[lost].pid)):
            fault_at = now
        if fault_at is not None and all(r in ended for r in range(n) if r != lost):
            break
        time.sleep(0.02)
    for p in procs:  # a stopped rank 0, or anything hung
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()
    child_wait_end = time.monotonic() + LINGER_S + 10
    children = _service_children(port)
    while children and time.monotonic() < child_wait_end:
        time.sleep(0.2)
        children = _service_children(port)
    for pid in children:  # left behind: a failure; do not leave it running
        os.kill(pid, signal.SIGKILL)
    texts = []
    for f in logs:
        f.seek(0)
        texts.append(f.read())
        f.close()
    return {"rc": [p.returncode for p in procs], "texts": texts, "fault_at": fault_at,
            "ended": ended, "start": start, "children_left": len(children),
            "seconds": time.monotonic() - start}


def judge_plain(fault: str, r: dict) -> dict:
    lost = CASES[fault][0]
    bound = GROUP_TIMEOUT_S + HEARTBEAT_S + SLACK_S
    named = re.compile(rf"(DistNetworkError|DistTimeoutError).*(lost ranks \[{lost}\]|"
                       rf"lost processes \[{lost}\]|ranks that did not arrive: \[{lost}\])")
    survivors = [s for s in range(len(r["rc"])) if s != lost]
    latency = [None if r["fault_at"] is None or s not in r["ended"]
               else round(r["ended"][s] - r["fault_at"], 2) for s in survivors]
    return {
        "fault happened": r["fault_at"] is not None,
        "survivors raised": all(r["rc"][s] == 1 for s in survivors),
        "named": all(named.search(r["texts"][s]) for s in survivors),
        "in time": all(x is not None and x <= bound for x in latency),
        "no C++ abort": not any(a in r["texts"][s] for s in survivors for a in CPP_ABORTS),
        "no child left": r["children_left"] == 0,
    }, latency


def lost_rank_aborted(fault: str, r: dict) -> bool:
    """Whether the rank the fault kills printed JAX's C++ fatal error before its SIGKILL
    landed (the service had already declared it dead): not a survivor, counted apart."""
    return any(a in r["texts"][CASES[fault][0]] for a in CPP_ABORTS)


FAULT_NAMES = {
    "killbefore:0:2": "rank 0 killed before a step's barrier",
    "killduring:0:2": "rank 0 killed 0.2 s into a step (in its collectives or checkpoint)",
    "ckpt:0:3": "rank 0 killed while committing a checkpoint",
    "raise:1:2": "rank 1 raises while the others wait in a barrier",
    "stop:0:3": "rank 0 SIGSTOPped",
}


def table(path: Path, configuration: str | None = None) -> str:
    """A markdown table of a results file's run (the default one, or the named
    configuration): good runs, median seconds per run and (without the launcher) the
    largest fault-to-exit latency, per fault and load."""
    rows = load_result(path, configuration)["rows"]
    plain = any(r.get("mode") == "nolauncher" for r in rows)  # older runs: launcher only
    cell = {(r["fault"], r["load"]): r for r in rows}
    extra = " | max latency s" if plain else ""
    lines = [f"| fault | no load: good | median s{extra} | 2 busy loops: good | median s{extra} |",
             "|---|---:|---:|" + ("---:|" if plain else "") + "---:|---:|" + ("---:|" if plain
                                                                              else "")]
    for fault in dict.fromkeys(r["fault"] for r in rows):
        parts = []
        for load in (False, True):
            r = cell.get((fault, load))
            if r is None:
                parts += ["-", "-"] + (["-"] if plain else [])
                continue
            median = np.median(r["seconds"]) if "seconds" in r else r["median_s"]  # older runs
            parts += [f"{r['good']}/{r['runs']}", f"{float(median):.0f}"]
            if plain:
                late = [x for run in r["latency_s"] for x in run if x is not None]
                parts.append(f"{max(late):.1f}" if late else "-")
        lines.append(f"| {FAULT_NAMES.get(fault, fault)} | " + " | ".join(parts) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=20, help="runs per mode, case and load")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--modes", default="launcher,nolauncher")
    p.add_argument("--coordinator", default="launcher", choices=("launcher", "rank0"),
                   help="launcher mode only; rank0: the baseline, rank 0's worker hosts it")
    p.add_argument("--loads", default="0,1", help="0 without load, 1 with two busy loops")
    p.add_argument("--tag", default="", help="the configuration's name with a leading '_' "
                   "(--tag _launcher is --configuration launcher)")
    p.add_argument("--out", default=str(RESULTS / "fault_stress.json"), help="the results file")
    add_flag(p)
    p.add_argument("--machine", default="2 shared CPU cores",
                   help="what else ran on the machine, recorded in the results")
    p.add_argument("--table", metavar="RESULTS", help="print the markdown table of a results "
                   "file's run (bench/results/fault_stress.json; --configuration names "
                   "one) and exit")
    args = p.parse_args()
    configuration = args.configuration or args.tag.lstrip("_") or None
    if args.table:
        print(table(Path(args.table), configuration))
        return
    modes, cases = args.modes.split(","), args.cases.split(",")
    loads = [bool(int(x)) for x in args.loads.split(",")]
    reference = {}
    if "launcher" in modes:
        with tempfile.TemporaryDirectory() as d:
            _, reference = run_launcher(Path(d), "none", 0)
    rows = {(m, c, ld): {"mode": m, "fault": c, "load": ld, "runs": 0, "good": 0,
                         "seconds": [], "latency_s": [], "failures": [],
                         "lost_rank_cpp_aborts": 0}
            for m in modes for c in cases for ld in loads}
    out = Path(args.out)
    for i in range(args.runs):
        for mode in modes:
            for load in loads:
                for fault in cases:
                    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                                for _ in range(2 * load)]
                    try:
                        with tempfile.TemporaryDirectory() as d:
                            if mode == "launcher":
                                res, params = run_launcher(Path(d), fault, 2, args.coordinator)
                                text = res["text"]
                                checks = {
                                    "exit 0": res["rc"] == 0,
                                    "named": re.search(CASES[fault][1], text) is not None,
                                    "no C++ abort": not any(a in text for a in CPP_ABORTS),
                                    "identical": params.keys() == reference.keys() and all(
                                        np.array_equal(params[k], reference[k])
                                        for k in reference),
                                }
                                latency, tail = [], text[-600:]
                            else:
                                res = run_plain(Path(d), fault)
                                checks, latency = judge_plain(fault, res)
                                rows[(mode, fault, load)]["lost_rank_cpp_aborts"] += \
                                    lost_rank_aborted(fault, res)
                                tail = " | ".join(t[-400:] for t in res["texts"])
                    finally:
                        for s in spinners:
                            s.kill()
                            s.wait()
                    row = rows[(mode, fault, load)]
                    row["runs"] += 1
                    row["seconds"].append(round(res["seconds"], 1))
                    row["latency_s"].append(latency)
                    if all(checks.values()):
                        row["good"] += 1
                    else:
                        row["failures"].append({
                            "run": i, "failed": [k for k, v in checks.items() if not v],
                            "tail": re.sub(r"\s+", " ", tail)})
                    print(f"round {i} {mode} load={load} {fault}: {checks} {latency}",
                          flush=True)
                    save(out, {
                        "machine": args.machine,
                        "steps": STEPS, "group_timeout_s": GROUP_TIMEOUT_S,
                        "heartbeat_s": HEARTBEAT_S, "linger_s": LINGER_S,
                        "command": "python bench/fault_stress.py " + " ".join(sys.argv[1:]),
                        "rows": list(rows.values())}, configuration)
    print(f"wrote {out}" + (f" (configuration {configuration})" if configuration else ""))


# python -m bench fault_stress --quick: a short run, written under /tmp unless --out is given
QUICK_ARGS = ["--runs", "1"]

if __name__ == "__main__":
    main()
