"""Asking every live process of the job, through the store, what it runs, or to dump.

A process that diagnoses a hang, or dumps its flight recorder after an error, writes a
*request* to the coordination service's key/value store: it raises the counter
``jaxpg_fr/requests`` to ``gen`` and sets ``jaxpg_fr/request/<gen>`` (JSON: who asks, why,
and whether to dump). Every process looks at the counter every ``_PERIOD`` seconds from a
thread of its own (one RPC; not the liveness thread, whose ``get_live_nodes`` waits while
a peer is stopped but not yet declared dead), answers each new request by
setting ``jaxpg_fr/ack/<gen>/<process>`` to its state (each group's last call: sequence
number, op, state, whether it is still compiling it) and, for a dump request, writes its
dump first. A process that never answers is stopped (SIGSTOP), hung where Python cannot
run, or dead; the liveness monitor tells the dead apart. This is torch's dump-on-timeout,
signalled through its store the same way.

Process signals (SIGUSR1, SIGTERM) that make it dump: ``jaxpg.supervision.fr_os_signals``.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxpg.supervision import compile_clock, fr_dump, fr_os_signals
from jaxpg.supervision.desync import fingerprint_text
from jaxpg.supervision.flight_recorder import recorder

__all__ = ["install", "start", "stop", "request", "collect", "local_state", "tick",
           "dump_everywhere", "process_state", "ACK_GRACE_S"]

_PERIOD = 0.5
ACK_GRACE_S = 4.0  # how long a diagnosis waits for the peers' answers
_REQUESTS = "jaxpg_fr/requests"


class _Signals:
    def __init__(self) -> None:
        self.client: Any = None
        self.state: Any = None
        self.handled = 0
        self.thread: threading.Thread | None = None
        self.stopping = threading.Event()
        self.registered = False
        self.last_dump_request = -1e9


_s = _Signals()


_quiet = threading.local()


class quiet:
    """Within the block, errors made on this thread (and swallowed: a diagnosis reading a
    store after a loss) do not dump."""

    def __enter__(self) -> None:
        _quiet.depth = getattr(_quiet, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _quiet.depth -= 1


def _on_failure(error: BaseException) -> None:
    """A DistTimeoutError, DistNetworkError or DistDesyncError was made: dump everywhere."""
    if _s.client is None or getattr(_quiet, "depth", 0):
        return
    text = f"{type(error).__name__}: {error}"
    fr_dump.note_error(text)
    dump_everywhere(text)


def install() -> None:
    """Hooks the recorder's dumps into the places that report failures (once)."""
    from jaxpg import errors
    from jaxpg.supervision import liveness, watchdog

    errors.on_failure(_on_failure)
    for module in (liveness, watchdog):
        module.before_teardown(_on_teardown)


def _on_teardown(text: str) -> None:
    fr_dump.note_error(text)
    dump_everywhere(text)


def start(state: Any, client: Any) -> None:
    """Starts answering requests (``init_process_group`` of a multi-process world).

    Args:
        state: the world's state.
        client: the coordination-service client.
    """
    install()
    _stop_thread()
    _s.client, _s.state = client, state
    _where.clear()
    _s.handled = _counter()
    try:  # where this process runs: a peer on the same host can tell dead from stopped
        client.key_value_set_bytes(
            f"jaxpg_fr/proc/{state.process_index}",
            json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode(),
            allow_overwrite=True)
    except Exception:  # noqa: BLE001
        pass
    fr_os_signals.install(_dump_here, on_term=recorder.enabled)
    _s.stopping = threading.Event()
    _s.thread = threading.Thread(target=_loop, args=(_s.stopping,), daemon=True,
                                 name="jaxpg-flight-recorder")
    _s.thread.start()
    if not _s.registered:
        atexit.register(_stop_thread)  # out of its RPC before the interpreter ends
        _s.registered = True


def _loop(stopping: threading.Event) -> None:
    while not stopping.wait(_PERIOD):
        try:
            tick()
        except Exception:  # noqa: BLE001 (keep answering)
            pass


def _stop_thread() -> None:
    thread, _s.thread = _s.thread, None
    if thread is None:
        return
    _s.stopping.set()
    if thread is not threading.current_thread():
        thread.join(timeout=10.0)  # out of its RPC (liveness.stop says why)


def stop() -> None:
    """Stops answering and gives the signals back (``destroy_process_group``)."""
    _stop_thread()
    _s.client = _s.state = None
    fr_os_signals.uninstall()


def _dump_here(trigger: str) -> None:
    if recorder.enabled and _s.state is not None:
        try:
            fr_dump.write_dump(trigger, _s.state)
        except OSError:
            pass


def _get(key: str) -> bytes | None:
    try:
        return _s.client.key_value_try_get_bytes(key)
    except Exception:  # noqa: BLE001 (not set yet, or the service is gone)
        return None


def _counter() -> int:
    value = _get(_REQUESTS) if _s.client is not None else None
    try:
        return int(value) if value else 0
    except ValueError:
        return 0


def local_state() -> dict[str, Any]:
    """What this process runs now: each group's last call, for a peer's diagnosis."""
    now = time.time()
    calls = {}
    for name, rec in list(recorder.last.items()):
        calls[name] = {
            "seq": rec.seq, "op": rec.op, "kind": rec.kind, "state": rec.state,
            "age_s": round(now - rec.started, 3),
            "compiling": rec.state == "started" and compile_clock.compiling(rec.thread),
            "text": fingerprint_text(name, rec.seq, rec.fingerprint),
            "location": rec.location(), "called": rec.called(),
        }
        prev = recorder.prev.get(name)
        if prev is not None:
            calls[name]["prev"] = {"seq": prev[0], "text": fingerprint_text(name, *prev)}
    state = _s.state
    return {"process": getattr(state, "process_index", 0),
            "ranks": list(getattr(state, "local_ranks", [])), "time": now, "calls": calls}


_where: dict[int, tuple[str, int]] = {}  # process -> (host, pid), read once


def process_state(process: int) -> tuple[str, int] | None:
    """``("gone" | "stopped" | "running", pid)`` of a process of the world that runs on this
    host (read from ``/proc``); None for one on another host, or unknown."""
    where = _where.get(process)
    if where is None:
        raw = _get(f"jaxpg_fr/proc/{process}") if _s.client is not None else None
        try:
            found = json.loads(raw) if raw else None
        except ValueError:
            found = None
        if not found:
            return None
        where = _where[process] = (found.get("host"), int(found["pid"]))
    host, pid = where
    if host != socket.gethostname():
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            status = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone", pid
    return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone"}.get(status, "running"), pid


def request(kind: str, reason: str, group: str | None = None, seq: int | None = None) -> int:
    """Asks every process for its state (``kind="state"``) or to dump (``"dump"``).

    Returns the request's number (0 when there is no store to ask through).
    """
    if _s.client is None:
        return 0
    state = _s.state
    try:
        gen = int(_s.client.key_value_increment(_REQUESTS, 1))
        body = {"from": state.process_index, "rank": state.local_ranks[0], "kind": kind,
                "reason": reason, "group": group, "seq": seq}
        _s.client.key_value_set_bytes(f"jaxpg_fr/request/{gen}", json.dumps(body).encode(),
                                      allow_overwrite=True)
    except Exception:  # noqa: BLE001 (the service is gone: nobody to ask)
        return 0
    if kind == "dump":
        _s.last_dump_request = time.monotonic()
    return gen


def collect(gen: int, procs: Sequence[int], grace: float,
            lost: Callable[[], Sequence[int]]) -> dict[int, dict[str, Any] | None]:
    """Each process's answer to request ``gen`` (None: no answer within ``grace`` s, or
    lost: those are not waited for)."""
    answers: dict[int, dict[str, Any] | None] = {p: None for p in procs}
    if not gen or _s.client is None:
        return answers
    deadline = time.monotonic() + grace
    while True:
        gone = set(lost())
        for p in procs:
            if answers[p] is None and p not in gone:
                raw = _get(f"jaxpg_fr/ack/{gen}/{p}")
                if raw is not None:
                    try:
                        answers[p] = json.loads(raw)
                    except ValueError:
                        answers[p] = {}
        waiting = [p for p in procs if answers[p] is None and p not in gone]
        # a peer on this host whose process is gone or stopped will not answer either
        waiting = [p for p in waiting if (process_state(p) or ("running",))[0] == "running"]
        if not waiting or time.monotonic() >= deadline:
            return answers
        time.sleep(0.05)


def dump_everywhere(trigger: str, signal_peers: bool = True) -> str | None:
    """Writes this process's dump and (at most every few seconds) asks every other live
    process to dump too. Returns this process's dump path (None with the recorder off)."""
    if not recorder.enabled:
        return None
    try:
        path = fr_dump.write_dump(trigger, _s.state)
    except OSError:
        path = None
    if signal_peers and time.monotonic() - _s.last_dump_request > 5.0:
        request("dump", trigger)
    return path


def tick() -> None:
    """Answers new requests and dumps on signals (the recorder's thread, every ``_PERIOD`` s)."""
    if _s.client is None:
        return
    fr_os_signals.poll()
    n = _counter()
    me = _s.state.process_index
    while _s.handled < n:
        gen = _s.handled + 1
        raw = _get(f"jaxpg_fr/request/{gen}")
        if raw is None:
            return  # its writer has not set it yet: next time
        _s.handled = gen
        try:
            body = json.loads(raw)
        except ValueError:
            continue
        if body.get("from") == me:
            continue
        if body.get("kind") == "dump" and recorder.enabled:
            try:
                fr_dump.write_dump(f"rank {body.get('rank')} asked: {body.get('reason')}",
                                   _s.state)
            except OSError:
                pass
        try:
            _s.client.key_value_set_bytes(f"jaxpg_fr/ack/{gen}/{me}",
                                          json.dumps(local_state()).encode(),
                                          allow_overwrite=True)
        except Exception:  # noqa: BLE001
            return
