"""What a call that did not finish is waiting for: the text of a named hang.

When a collective or a recorded jitted step does not finish within the group's timeout
(or fails in XLA), the process asks every peer of the group what it runs
(``jaxpg.supervision.fr_requests``: each live peer answers within a poll period), reads the
progress records of those that do not answer, and names, per rank:

* ``rank 1 never started it (its last call: barrier #4, waiting at train.py:52)``: its last
  call on the group is an earlier one, or a different call at the same sequence number
  (uneven data: it left its training loop one step early);
* ``rank 1 does not answer (stopped, or hung where Python cannot run)``;
* ``rank 1 died (the coordination service lost it)`` or ``left the job``.

The call's name is the one most ranks run at that sequence number, so every rank, the odd
one included, prints the same diagnosis: ``DistributedDataParallel.train_step #4 on group
'WORLD' did not finish within 6.0 s: rank 1 never started it (its last call: barrier #4,
waiting)``. A peer that is still compiling the same call is no hang: the caller waits on.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxpg.supervision import fr_dump, fr_requests, liveness
from jaxpg.supervision.desync import describe_mismatch, fingerprint_text
from jaxpg.supervision.flight_recorder import recorder
from jaxpg.supervision.progress import progress as _progress

__all__ = ["Diagnosis", "diagnose", "processes_of", "ranks_of_processes"]

_DETAIL_HINT = " Run with JAXPG_DEBUG=DETAIL to catch this before the collective runs."
_UNEVEN_HINT = (" Uneven data? A rank that runs out of batches stops calling the step before "
                "the others: see `with ddp.join():` in docs/debugging.md.")


def _earlier_mismatch(group: Any, calls: dict[int, dict | None], procs: list[int],
                      state: Any) -> str | None:
    """A call of the group at one sequence number that this process and a peer ran with
    different fingerprints (this process's last two calls against each peer's), or None."""
    name = group.group_name
    mine: dict[int, str] = {}
    last = recorder.last.get(name)
    prev = recorder.prev.get(name)
    if prev is not None:
        mine[prev[0]] = fingerprint_text(name, *prev)
    if last is not None:
        mine[last.seq] = fingerprint_text(name, last.seq, last.fingerprint)
    me = state.process_index
    my_rank = ranks_of_processes(state, [me], group.members)[0]
    for p in procs:
        call = calls.get(p)
        if p == me or not call:
            continue
        theirs = [(call.get("seq"), call.get("text")), *(
            [(call["prev"]["seq"], call["prev"]["text"])] if call.get("prev") else [])]
        for seq, text in theirs:
            if seq in mine and text and text != mine[seq]:
                rank = ranks_of_processes(state, [p], group.members)[0]
                found = describe_mismatch({my_rank: mine[seq], rank: text})
                if found:
                    return f"at #{seq}: {found}"
    return None


def processes_of(state: Any, ranks: Sequence[int]) -> list[int]:
    """The processes that hold ``ranks``, sorted."""
    return sorted({state.devices[r].process_index for r in ranks})


def ranks_of_processes(state: Any, procs: Sequence[int], ranks: Sequence[int]) -> list[int]:
    """The ranks among ``ranks`` that live in ``procs``."""
    wanted = set(procs)
    return [r for r in ranks if state.devices[r].process_index in wanted]


@dataclass
class Diagnosis:
    """A named hang.

    Attributes:
        text: the error's message.
        extend: a peer is still compiling this call: not a hang yet, wait on.
        at_fault: the ranks the text names as the cause.
    """

    text: str
    extend: bool = False
    at_fault: list[int] = field(default_factory=list)


def _published(group: Any, procs: Sequence[int], seq: int, grace: float) -> dict[int, dict]:
    """The progress records (counter, running text) of ``procs`` that did not answer.

    Counters are written in the background, so a counter below ``seq`` gets ``grace`` s to
    catch up."""
    store = group.store
    deadline = time.monotonic() + grace

    def read(p: int) -> dict:
        out: dict[str, Any] = {"seq": 0, "op": None, "text": None}
        try:
            key = f"progress/{p}"
            out["seq"] = int(store.get(key)) if store.check([key]) else 0
            key = f"running/{p}"
            if store.check([key]):
                text = store.get(key).decode()
                if (f"seq={out['seq']})" in text or f"seq={out['seq']}," in text) \
                        and "(group=" in text:
                    out["text"], out["op"] = text, text[:text.index("(group=")]
        except Exception:  # noqa: BLE001 (a dead store: say what we have)
            pass
        return out

    while True:
        found = {p: read(p) for p in procs}
        if all(f["seq"] >= seq for f in found.values()) or time.monotonic() >= deadline:
            return found
        time.sleep(0.02)


def _describe(call: dict | None) -> str:
    if not call or not call.get("op"):
        return "no call on this group yet" if not call or not call.get("seq") else \
            f"call #{call['seq']}"
    text = f"{call.get('called') or call['op']} #{call['seq']}"
    state = call.get("state")
    if state in ("started", "timed out"):  # timed out: it gave up waiting, it is still there
        text += ", waiting" if not call.get("compiling") else ", compiling"
    elif state:
        text += ", finished" if state == "completed" else f", {state}"
    if call.get("location"):
        text += f" at {call['location']}"
    return text


def diagnose(group: Any, api: str, seq: int, seconds: float,
             failure: str | None = None, waiting: bool = False) -> Diagnosis:
    """Names what the call ``api`` #``seq`` on ``group`` waits for (see the module doc).

    Args:
        group: the ProcessGroup.
        api: this process's op or step name.
        seq: the call's sequence number on the group.
        seconds: the timeout that ran out (for the text).
        failure: the XLA error's text when the call failed instead of timing out.
        waiting: the call is still waiting (a hang report, ``jaxpg.supervision.hang_report``):
            the text says it has waited ``seconds`` so far.
    """
    state = group._world
    name = group.group_name
    me = state.process_index
    procs = processes_of(state, group.members)
    peers = [p for p in procs if p != me]
    how = (f"failed ({failure})" if failure else f"has waited {seconds:.1f} s" if waiting
           else f"did not finish within {seconds:.1f} s")
    if not peers:
        return Diagnosis(f"{api} #{seq} on group {name!r} {how}; ranks that did not arrive: "
                         "[] (this process holds every rank of the group: the collective, or "
                         "device work queued ahead of it, is still running).")
    with fr_requests.quiet():  # store reads after a loss raise: that is no new failure
        _progress.publish_now(group)
        gen = fr_requests.request("state", f"{api} #{seq} on group {name!r} {how}", name, seq)
        answers = fr_requests.collect(gen, peers, fr_requests.ACK_GRACE_S, liveness.lost)
        lost, left = set(liveness.lost()), set(liveness.left())
        published = _published(group, [p for p in peers if answers[p] is None], seq, 0.25)
    mine = recorder.last.get(name)
    calls: dict[int, dict | None] = {me: {
        "seq": seq, "op": api, "state": "started", "kind": mine.kind if mine else None,
        "text": fingerprint_text(name, seq, mine.fingerprint) if mine and mine.seq == seq
        else f"{api}(group={name!r}, seq={seq})",
        "location": mine.location() if mine and mine.seq == seq else None}}
    status = {me: "answered"}
    pids: dict[int, int] = {}
    for p in peers:
        answer = answers[p]
        calls[p] = (answer.get("calls", {}).get(name) if answer is not None else published[p])
        status[p] = ("lost" if p in lost else "left" if p in left
                     else "answered" if answer is not None else "no response")
        if status[p] == "no response":  # on this host, /proc tells dead from stopped
            local = fr_requests.process_state(p)
            if local is not None and local[0] != "running":
                status[p], pids[p] = local

    at_seq = {p: c for p, c in calls.items() if c and c.get("seq") == seq and c.get("op")}
    ops = Counter(c["op"] for c in at_seq.values())
    top = max(ops.values())
    frame = next(at_seq[p]["op"] for p in sorted(at_seq) if ops[at_seq[p]["op"]] == top)
    clauses, at_fault, missing, extend = [], [], [], False
    for p in procs:
        ranks = ranks_of_processes(state, [p], group.members)
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        call, st = calls[p], status[p]
        reached = bool(call and call.get("seq", 0) >= seq)
        same = bool(call and call.get("seq") == seq and call.get("op") == frame)
        if st == "lost":
            clauses.append(f"{who} died (the coordination service lost it) "
                           + ("during it" if same else f"after its last call: {_describe(call)}"))
        elif st == "left":
            clauses.append(f"{who} left the job (its script ended) after its last call: "
                           f"{_describe(call)}")
        elif st in ("no response", "gone", "stopped"):
            why = {"gone": f"died (its process {pids.get(p)} on this host is gone)",
                   "stopped": f"is stopped (its process {pids.get(p)} on this host is in state "
                              "T: SIGSTOP, or a debugger)",
                   "no response": "does not answer (stopped, dead, or hung where Python cannot "
                                  "run)"}[st]
            clauses.append(f"{who} {why}; its last call known: {_describe(call)}"
                           + ("" if reached else " (it never reported starting this one)"))
        elif same:
            extend |= bool(call.get("compiling"))
            continue
        else:
            clauses.append(f"{who} never started it (its last call: {_describe(call)})"
                           if not (call and call.get("seq", 0) > seq)
                           else f"{who} is past it (its last call: {_describe(call)})")
        at_fault += ranks
        if not same:
            missing += ranks
    text = f"{frame} #{seq} on group {name!r} {how}: "
    if clauses:
        text += "; ".join(clauses)
    else:
        text += ("every rank started it and waits in it (a peer may have died during the "
                 "collective, or device work queued ahead of it is still running)")
    text += f"; ranks that did not arrive: {sorted(missing)}."
    steps = any(c.get("kind") == "step" for c in at_seq.values())
    texts = {ranks_of_processes(state, [p], group.members)[0]: c["text"]
             for p, c in at_seq.items() if c.get("text")}
    mismatch = describe_mismatch(texts) if len(texts) > 1 and not steps else None
    if not mismatch and not steps:  # an earlier call of the group differed: the cause
        mismatch = _earlier_mismatch(group, calls, procs, state)
    if mismatch:  # eager calls: their shapes and arguments are the cause; say it first
        head = f"{frame} #{seq} on group {name!r} {how}: "
        text = (f"{head}the ranks called a collective with different shapes or arguments (the "
                f"cause; what follows is its consequence): {mismatch.rstrip('.')}."
                f"{_DETAIL_HINT} Then: " + text[len(head):])
    if steps and any(c["op"] != frame for c in at_seq.values()):
        text += _UNEVEN_HINT
    fr_dump.note_diagnosis({
        "text": text, "group": name, "seq": seq,
        "peers": {str(p): {"ranks": ranks_of_processes(state, [p], group.members),
                           "status": status[p], "last_call": calls[p]} for p in procs}})
    return Diagnosis(text, extend=extend and not clauses, at_fault=sorted(at_fault))
