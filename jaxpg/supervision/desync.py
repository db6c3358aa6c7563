"""Collective fingerprints and desync detection (``JAXPG_DEBUG=DETAIL``).

A fingerprint says which collective a process is running: the op, the group, the sequence
number, every input's per-rank shape and dtype, and the static arguments (reduce op,
src/dst). Eager collectives make one per call as a cheap tuple; it becomes text only when
needed:

* always, on the progress record (``<group>/running/<process>``, written in the background
  with the progress counter), so a timeout in which every rank arrived says what each rank
  is running;
* under ``JAXPG_DEBUG=DETAIL`` (or torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``), before each
  eager collective: every process writes its fingerprint to the group's store and reads the
  others', and a mismatch raises ``DistDesyncError`` on every rank before the collective
  runs (torch's ``ProcessGroupWrapper``). This costs one store write and a read of every
  other process's key per collective (a few milliseconds through JAX's coordination
  service: a debugging mode, as torch's).
"""

from __future__ import annotations

import datetime
import os
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from jaxpg.errors import DistDesyncError, DistTimeoutError

__all__ = ["detail_enabled", "fingerprint_text", "compare_fingerprints"]


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # <function gelu at 0x7f93...>


def detail_enabled() -> bool:
    """True under ``JAXPG_DEBUG=DETAIL`` or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``."""
    value = os.environ.get("JAXPG_DEBUG") or os.environ.get("TORCH_DISTRIBUTED_DEBUG") or ""
    return value.strip().upper() == "DETAIL"


def fingerprint_text(group_name: str, seq: int | None, fingerprint: Any) -> str:
    """``all_reduce(group='WORLD', seq=3, x=float32[4], args=ReduceOp.SUM)``.

    Args:
        group_name: the group's name.
        seq: the collective's sequence number in the group (None: left out).
        fingerprint: ``(api, static arguments, ((name, shape, dtype), ...))`` or None; a
            shape of None shows ``dtype`` alone (a recorded step's summary of an argument).
    """
    at = [] if seq is None else [f"seq={seq}"]
    if fingerprint is None:
        return f"collective({', '.join([f'group={group_name!r}', *at])})"
    api, static, inputs = fingerprint
    parts = [f"group={group_name!r}", *at]
    parts += [f"{name}={dtype}" if shape is None else f"{name}={dtype}{list(shape)}"
              for name, shape, dtype in inputs]
    if static is not None:  # without memory addresses, which differ between processes
        parts.append("args=" + _ADDRESS.sub("", repr(static)))
    return f"{api}({', '.join(parts)})"


def _odd_ones(texts: dict[int, str]) -> tuple[str, list[int]]:
    """The most common fingerprint (ties: the lowest rank's) and the ranks that differ."""
    counts = Counter(texts.values())
    best = max(counts.values())
    common = next(t for _, t in sorted(texts.items()) if counts[t] == best)
    return common, [r for r, t in sorted(texts.items()) if t != common]


def describe_mismatch(texts: dict[int, str]) -> str | None:
    """Names the ranks whose fingerprint differs and both fingerprints; None if all agree."""
    common, odd = _odd_ones(texts)
    if not odd:
        return None
    first = min(r for r, t in texts.items() if t == common)
    lines = [f"rank {first} (and every rank not named) is running {common}"]
    lines += [f"rank {r} is running {texts[r]}" for r in odd]
    return (f"ranks {odd} differ from rank {first}: " + "; ".join(lines) + ".")


def compare_fingerprints(store: Any, seq: int, me: int, text: str, procs: Sequence[int],
                         rank_of: dict[int, int], timeout: datetime.timedelta,
                         api: str, group_name: str) -> None:
    """Exchanges this process's fingerprint with the group's other processes and raises
    ``DistDesyncError`` on a mismatch (every process sees the same texts, so all raise).

    Args:
        store: the group's store.
        seq: the sequence number (keys are ``detail/<seq>/<process>``).
        me: this process's index.
        text: this process's fingerprint text.
        procs: the group's processes.
        rank_of: process -> the rank named for it in messages.
        timeout: the group's timeout: a process that never writes its key is named.
        api, group_name: for messages.

    The caller deletes this process's key of ``seq - 2`` later (every process has read it
    once any process writes ``seq``), off the collective's path.
    """
    store.set(f"detail/{seq}/{me}", text)
    keys = {p: f"detail/{seq}/{p}" for p in procs if p != me}
    try:
        store.wait(list(keys.values()), timeout)
    except Exception:  # noqa: BLE001 (the store's timeout: say who never arrived)
        missing = [rank_of[p] for p, k in keys.items() if not store.check([k])]
        raise DistTimeoutError(
            f"{api} #{seq} on group {group_name!r}: ranks {missing} did not "
            f"reach it within {timeout.total_seconds():.1f} s (JAXPG_DEBUG=DETAIL fingerprint "
            "check)."
        ) from None
    texts = {rank_of[p]: store.get(k).decode() for p, k in keys.items()}
    texts[rank_of[me]] = text
    problem = describe_mismatch(texts)
    if problem:
        raise DistDesyncError(
            f"Detected mismatch between collectives on group {group_name!r} at sequence "
            f"number {seq}: {problem} Every rank must call the same collectives in the same "
            "order with the same shapes, dtypes and arguments."
        )
