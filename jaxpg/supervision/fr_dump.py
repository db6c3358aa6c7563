"""Flight-recorder dumps: one JSON Lines file per process, and reading them back.

Format ``jaxpg-flight-recorder``, version 1 (documented in docs/debugging.md): the first
line is a header object (``"type": "header"``), then one ``"type": "call"`` object per
recorded call, oldest first, and a last ``{"type": "end", "calls": n}`` line. A file cut
short (a process killed while writing) has no end line: :func:`read_dump` returns the
lines it could parse and ``partial=True``.

The file is ``<prefix><rank>`` (the process's first global rank): the prefix is
``$JAXPG_FR_DUMP_DIR/jaxpg_fr_rank_``, else torch's ``TORCH_FR_DUMP_TEMP_FILE`` as given,
else ``<temp dir>/jaxpg_fr_rank_``. A later dump of the same process replaces the file.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import jax

from jaxpg.supervision import liveness
from jaxpg.supervision.flight_recorder import CallRecord, recorder

__all__ = ["FORMAT", "VERSION", "DEFAULT_NAME", "dump_prefix", "write_dump", "read_dump",
           "Dump", "note_error", "note_diagnosis", "record_json"]

FORMAT = "jaxpg-flight-recorder"
VERSION = 1
DEFAULT_NAME = "jaxpg_fr_rank_"
_lock = threading.RLock()
_errors: list[str] = []  # the errors this process raised (first and last few)
_diagnosis: dict[str, Any] = {}  # the last hang diagnosis: text and what each peer said


def dump_prefix() -> str:
    """Where dumps go: ``<prefix><rank>`` (see the module docstring)."""
    directory = os.environ.get("JAXPG_FR_DUMP_DIR", "").strip()
    if directory:
        return os.path.join(directory, DEFAULT_NAME)
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE", "").strip()
    if prefix:
        return prefix
    return os.path.join(tempfile.gettempdir(), DEFAULT_NAME)


def note_error(text: str) -> None:
    """Keeps an error's text for the header (the first two and the last eight)."""
    _errors.append(text)
    if len(_errors) > 10:
        del _errors[2:-8]


def note_diagnosis(diagnosis: dict[str, Any]) -> None:
    """Keeps the last hang diagnosis (its text and each peer's state) for the header."""
    _diagnosis.clear()
    _diagnosis.update(diagnosis)


def _static_json(record: CallRecord, static: Any) -> Any:
    ranks = recorder.groups.get(record.group, ())
    if record.group.startswith("p2p_") and isinstance(static, tuple) and len(static) == 2:
        src, dst = static
        return {"src": ranks[src], "dst": ranks[dst]}
    if static is None:
        return None
    if isinstance(static, (int, float, str, bool)):
        return static
    return repr(static)


def record_json(record: CallRecord) -> dict[str, Any]:
    """One record as the dump's ``call`` object."""
    out: dict[str, Any] = {"type": "call", "id": record.id, "group": record.group,
                           "seq": record.seq, "op": record.op, "kind": record.kind}
    called = record.called()
    if called is not None:
        out["called"] = called
    fingerprint = record.fingerprint
    if fingerprint is not None:
        _, static, inputs = fingerprint
        out["inputs"] = [[name, None if shape is None else list(shape), str(dtype)]
                         for name, shape, dtype in inputs]
        out["args"] = _static_json(record, static)
    if record.collectives is not None:
        out["collectives"] = list(record.collectives)
    out.update(state=record.state, started=record.started, ended=record.ended)
    if record.error is not None:
        out["error"] = record.error
    if record.caller is not None and record.caller[0] is not None:
        code, line, _ = record.caller
        out["caller"] = {"file": code.co_filename, "line": line, "function": code.co_name}
    return out


def _header(state: Any, trigger: str) -> dict[str, Any]:
    ranks = list(state.local_ranks) if state is not None else []
    return {
        "type": "header", "format": FORMAT, "version": VERSION, "time": time.time(),
        "trigger": trigger, "errors": list(_errors),
        "process": getattr(state, "process_index", 0),
        "process_count": getattr(state, "process_count", 1),
        "ranks": ranks, "world_size": len(state.devices) if state is not None else 0,
        "host": socket.gethostname(), "pid": os.getpid(), "buffer_size": recorder.size,
        "jax_version": jax.__version__,
        "groups": {name: {"ranks": list(r), "last_seq": recorder.last[name].seq
                          if name in recorder.last else 0}
                   for name, r in recorder.groups.items()},
        "lost_processes": liveness.lost(),
        "diagnosis": dict(_diagnosis) or None,
    }


def write_dump(trigger: str, state: Any, path: str | None = None) -> str:
    """Writes this process's dump and returns its path.

    Args:
        trigger: why (an error's text, ``"SIGUSR1"``, a peer's request, ...).
        state: the world's state (``jaxpg.groups.world.WorldState``), or None.
        path: the file; default ``dump_prefix()`` + this process's first rank.
    """
    if path is None:
        rank = state.local_ranks[0] if state is not None else 0
        path = f"{dump_prefix()}{rank}"
    with _lock:
        records = recorder.records()
        lines = [json.dumps(_header(state, trigger), default=str)]
        lines += [json.dumps(record_json(r), default=str) for r in records]
        lines.append(json.dumps({"type": "end", "calls": len(records)}))
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
    return path


@dataclass
class Dump:
    """One process's dump as read back.

    Attributes:
        path: the file.
        header: the header object (empty if even the first line was cut).
        calls: the call objects, oldest first.
        partial: True when the file was cut short (no end line).
    """

    path: str
    header: dict[str, Any] = field(default_factory=dict)
    calls: list[dict[str, Any]] = field(default_factory=list)
    partial: bool = False


def read_dump(path: str) -> Dump:
    """Reads a dump, keeping whatever a file cut short still holds.

    Raises:
        ValueError: if the file is not a jaxpg flight-recorder dump, or is of a newer
            version than this reader.
    """
    dump = Dump(path, partial=True)
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f):
            try:
                item = json.loads(line)
            except ValueError:
                break  # the line a kill cut short: everything before it stands
            kind = item.get("type") if isinstance(item, dict) else None
            if number == 0:
                if kind != "header" or item.get("format") != FORMAT:
                    raise ValueError(f"{path} is not a {FORMAT} dump (its first line is "
                                     f"{line[:80]!r}).")
                if int(item.get("version", 0)) > VERSION:
                    raise ValueError(f"{path} is a version {item.get('version')} dump; this "
                                     f"jaxpg reads up to version {VERSION}: upgrade jaxpg.")
                dump.header = item
            elif kind == "call":
                dump.calls.append(item)
            elif kind == "end":
                dump.partial = False
    return dump
