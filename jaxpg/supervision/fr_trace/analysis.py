"""Merging a job's flight-recorder dumps into one verdict (``jaxpg-fr-trace``).

The dumps (``jaxpg.supervision.fr_dump``: one per process) are read, partial ones included,
and compared group by group, sequence number by sequence number. The verdict names, by
rank and by the names the user called:

1. ``mismatch``: the first group and sequence number where the ranks' calls differ (op or
   step name, inputs' shapes and dtypes, arguments, a step's collectives): the odd ranks,
   what they called and where, against what the others called;
2. ``not_arrived``: else, the first call some ranks started and others never reached, and
   where each of those was instead (its last call);
3. ``stuck``: else, the first call every dumped rank started and some never finished;
4. and, with any of these, the ranks with no dump, with what their peers learned of them
   (dead, stopped, not answering; their last call known).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from jaxpg.supervision.fr_dump import DEFAULT_NAME, Dump, read_dump

__all__ = ["Proc", "load_dumps", "analyze"]


@dataclass
class Proc:
    """One process as its dump tells it."""

    process: int
    ranks: list[int]
    dump: Dump
    by_seq: dict[str, dict[int, dict[str, Any]]]  # group -> seq -> its last record of it

    @property
    def name(self) -> str:
        return _ranks_text(self.ranks)


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_join(ranks)}"


def _join(items: list[Any]) -> str:
    return ", ".join(str(i) for i in items)


def load_dumps(paths: list[str], prefix: str = DEFAULT_NAME) -> tuple[list[Proc], list[str]]:
    """Reads the dumps in ``paths`` (files, or directories: their files named ``prefix*``,
    else every file that is a dump). Returns the processes and the problems met."""
    files, problems = [], []
    for path in paths:
        if os.path.isdir(path):
            names = sorted(n for n in os.listdir(path)
                           if os.path.isfile(os.path.join(path, n)))
            chosen = [n for n in names if n.startswith(prefix)] or names
            files += [os.path.join(path, n) for n in chosen]
        elif os.path.exists(path):
            files.append(path)
        else:
            problems.append(f"{path}: no such file or directory")
    procs = []
    for path in files:
        try:
            dump = read_dump(path)
        except (ValueError, OSError) as err:
            if path in paths:  # named explicitly: say why it is skipped
                problems.append(str(err))
            continue
        header = dump.header
        digits = re.search(r"(\d+)\D*$", os.path.basename(path))
        ranks = [int(r) for r in header.get("ranks") or ([int(digits.group(1))] if digits else [])]
        process = int(header.get("process", ranks[0] if ranks else -1))
        by_seq: dict[str, dict[int, dict]] = {}
        for call in dump.calls:
            by_seq.setdefault(call["group"], {})[int(call["seq"])] = call
        procs.append(Proc(process, ranks, dump, by_seq))
        if dump.partial:
            problems.append(f"{path}: cut short (a process killed while writing it?); "
                            f"read {len(dump.calls)} calls")
    procs.sort(key=lambda p: p.process)
    return procs, problems


def _signature(call: dict[str, Any]) -> tuple:
    return (call.get("op"), repr(call.get("inputs")), repr(call.get("args")),
            repr(call.get("collectives")) if call.get("kind") == "step" else None)


def describe_call(call: dict[str, Any] | None, with_group: bool = True) -> str:
    """``barrier #7 on group 'g' (x=int32[1]; timed out) at train.py:52``."""
    if not call:
        return "no recorded call"
    text = f"{call.get('op')} #{call.get('seq')}"
    if with_group:
        text += f" on group {call.get('group')!r}"
    details = [f"{name}={dtype}" if shape is None else f"{name}={dtype}{shape}"
               for name, shape, dtype in call.get("inputs") or []]
    if call.get("args") not in (None, "None"):
        details.append(f"args={call['args']}")
    if call.get("kind") == "step" and call.get("collectives"):
        details.append("collectives: " + ", ".join(call["collectives"]))
    details.append(call.get("state", "?"))
    text += f" ({'; '.join(details)})"
    if call.get("caller"):
        caller = call["caller"]
        text += f" at {_short(caller['file'])}:{caller['line']}"
        if call.get("called") and call.get("called") != call.get("op"):
            text += f" (called {call['called']})"
    return text


def _short(path: str) -> str:
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return path if relative.startswith("..") else relative


def _last_call(proc: Proc) -> dict[str, Any] | None:
    return max(proc.dump.calls, key=lambda c: c.get("id", 0), default=None)


def _missing(procs: list[Proc]) -> list[dict[str, Any]]:
    """The processes without a dump, and what the others' headers say of them."""
    seen = {p.process for p in procs}
    count = max([int(p.dump.header.get("process_count", 0)) for p in procs] or [0])
    out = []
    for q in range(count):
        if q in seen:
            continue
        entry: dict[str, Any] = {"process": q, "ranks": [q], "status": "no dump"}
        for p in procs:
            header = p.dump.header
            peer = ((header.get("diagnosis") or {}).get("peers") or {}).get(str(q))
            if peer:
                entry.update(ranks=peer.get("ranks", [q]), status=peer.get("status"),
                             last_call=peer.get("last_call"))
            if q in (header.get("lost_processes") or []):
                entry["status"] = "lost"
        out.append(entry)
    return out


def _first_mismatch(procs: list[Proc], group: str) -> dict[str, Any] | None:
    seqs = sorted({s for p in procs for s in p.by_seq.get(group, {})})
    for seq in seqs:
        calls = {p.process: p.by_seq[group][seq] for p in procs if seq in p.by_seq.get(group, {})}
        if len(calls) < 2:
            continue
        sigs = {q: _signature(c) for q, c in calls.items()}
        counts = Counter(sigs.values())
        if len(counts) == 1:
            continue
        top = max(counts.values())
        common = next(sigs[q] for q in sorted(sigs) if counts[sigs[q]] == top)
        return {"group": group, "seq": seq, "calls": calls,
                "odd": [q for q in sorted(sigs) if sigs[q] != common],
                "common": [q for q in sorted(sigs) if sigs[q] == common]}
    return None


def _first_unarrived(procs: list[Proc], group: str) -> dict[str, Any] | None:
    members = [p for p in procs if group in p.by_seq]
    if len(members) < 2:
        return None
    # a dump cut short may lack its last calls: it shows where a rank got, not where it stopped
    last = {p.process: max(p.by_seq[group]) for p in members if not p.dump.partial}
    if not last:
        return None
    low, high = min(last.values()), max(max(p.by_seq[group]) for p in members)
    if low == high:
        return None
    seq = low + 1
    behind = [q for q, s in last.items() if s < seq]
    ahead = [p for p in members if seq in p.by_seq[group]]
    return {"group": group, "seq": seq, "behind": sorted(behind),
            "calls": {p.process: p.by_seq[group][seq] for p in ahead}}


def _first_unfinished(procs: list[Proc], group: str) -> dict[str, Any] | None:
    seqs = sorted({s for p in procs for s in p.by_seq.get(group, {})})
    for seq in seqs:
        calls = {p.process: p.by_seq[group][seq] for p in procs if seq in p.by_seq.get(group, {})}
        if any(c.get("state") != "completed" for c in calls.values()):
            return {"group": group, "seq": seq, "calls": calls}
    return None


def analyze(procs: list[Proc]) -> dict[str, Any]:
    """The verdict over the processes' dumps (see the module docstring), as a dict whose
    ``"text"`` is the human-readable report."""
    by_process = {p.process: p for p in procs}
    ranks_of = {p.process: p.ranks for p in procs}
    missing = _missing(procs)
    for m in missing:
        ranks_of[m["process"]] = m["ranks"]
    groups = sorted({g for p in procs for g in p.by_seq})
    verdict: dict[str, Any] = {"verdict": "no problem found", "culprit_ranks": [],
                               "missing": missing, "dumps": [p.dump.path for p in procs]}
    lines = []

    def who(qs: list[int]) -> str:
        return _ranks_text(sorted(r for q in qs for r in ranks_of.get(q, [q])))

    found = None
    for finder, kind in ((_first_mismatch, "mismatch"), (_first_unarrived, "not_arrived"),
                         (_first_unfinished, "stuck")):
        candidates = [f for f in (finder(procs, g) for g in groups) if f]
        if candidates:
            found = min(candidates, key=lambda f: min(c.get("started", 0)
                                                      for c in f["calls"].values()))
            found["kind"] = kind
            break
    if found is not None:
        group, seq, calls = found["group"], found["seq"], found["calls"]
        verdict.update(verdict=found["kind"], group=group, seq=seq)
        if found["kind"] == "mismatch":
            odd, common = found["odd"], found["common"]
            verdict["culprit_ranks"] = sorted(r for q in odd for r in ranks_of[q])
            lines.append(f"Ranks disagree at group {group!r} #{seq}: "
                         + "; ".join(f"{who([q])} called {describe_call(calls[q], False)}"
                                     for q in odd)
                         + f", where {who(common)} called "
                         + describe_call(calls[common[0]], False) + ".")
            op = calls[common[0]].get("op")
            if calls[common[0]].get("kind") == "step":
                counts = {q: sum(1 for c in by_process[q].dump.calls if c.get("op") == op)
                          for q in calls}
                if len(set(counts.values())) > 1:
                    lines.append("  Uneven data? Recorded calls of " + op + ": " + "; ".join(
                        f"{who([q])}: {n}" for q, n in sorted(counts.items()))
                        + " (a rank that runs out of batches stops calling the step: see "
                          "`with ddp.join():`).")
        elif found["kind"] == "not_arrived":
            behind = found["behind"]
            verdict["culprit_ranks"] = sorted(r for q in behind for r in ranks_of[q])
            first = next(iter(calls.values()))
            lines.append(f"{who(behind)} never arrived at {describe_call(first)}, which "
                         f"{who(list(calls))} started.")
        else:
            waiting = sorted(calls)
            lines.append(f"{who(waiting)} started {describe_call(calls[waiting[0]])} and it "
                         "never finished.")
        verdict["calls"] = {str(q): c for q, c in calls.items()}
    if missing:
        absent = [m["process"] for m in missing]
        if found is None or not verdict["culprit_ranks"]:
            verdict["culprit_ranks"] = sorted(r for m in missing for r in m["ranks"])
            if found is None:
                verdict["verdict"] = "missing_dumps"
        for m in missing:
            status = {"no dump": "its peers learned nothing of it (it may have died before "
                                 "they noticed; the launcher's output says how it ended)",
                      "lost": "lost: the coordination service stopped hearing from it",
                      "gone": "dead: its process was gone when a peer looked",
                      "stopped": "stopped (SIGSTOP or a debugger) when a peer looked",
                      "no response": "it did not answer its peers (stopped, dead or hung)",
                      "left": "it left the job cleanly"}.get(m["status"], m["status"])
            last = m.get("last_call")
            known = (f"; its last call known to its peers: {last.get('op') or 'call'} "
                     f"#{last.get('seq')}" if last and last.get("seq") else "")
            lines.append(f"{who([m['process']])} has no dump: {status}{known}.")
        verdict["missing_processes"] = absent
    if not lines:
        lines.append("No problem found: every rank made the same calls and finished them.")
    lines.append("Where each rank was (its last recorded call):")
    for p in procs:
        partial = " [dump cut short]" if p.dump.partial else ""
        lines.append(f"  {p.name}: {describe_call(_last_call(p))}{partial}")
    verdict["text"] = "\n".join(lines)
    return verdict
