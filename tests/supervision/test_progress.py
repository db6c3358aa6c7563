"""The progress publisher: what it writes to a group's store, and that its thread is out of
the store before the interpreter ends (a daemon thread inside the coordination client's RPC
during finalization aborts the process: "terminate called without an active exception")."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

from jaxpg.stores import HashStore
from jaxpg.supervision.progress import _Progress


class _Group:
    """What the publisher reads of a process group (hashable, as a group is)."""

    group_name = "WORLD"

    def __init__(self, store, process_index: int = 1) -> None:
        self.store = store
        self._world = types.SimpleNamespace(process_index=process_index)


def _group():
    return _Group(HashStore())


def test_counter_moves_by_what_was_reached_and_the_text_names_the_collective():
    p, g = _Progress(), _group()
    try:
        p.note(g, 3, None)
        p.publish_now(g)
        assert g.store.add("progress/1", 0) == 3
        assert "seq=3" in g.store.get("running/1").decode()
        p.note(g, 5, None)
        p.publish_now(g, texts=False)
        assert g.store.add("progress/1", 0) == 5
    finally:
        p.forget()


def test_stop_joins_the_thread_and_a_new_world_starts_another():
    p, g = _Progress(), _group()
    p.note(g, 1, None)
    first = p._thread
    assert first is not None and first.is_alive()
    p.forget()
    assert not first.is_alive()
    p.note(g, 1, None)
    assert p._thread is not None and p._thread is not first and p._thread.is_alive()
    p.forget()


def test_the_thread_has_stopped_before_the_interpreter_finalizes():
    script = textwrap.dedent("""
        import atexit, threading, time, types
        def check():  # registered first, so it runs after every later atexit handler
            alive = [t.name for t in threading.enumerate() if t.name == "jaxpg-progress"]
            print("ALIVE" if alive else "STOPPED", flush=True)
        atexit.register(check)
        from jaxpg.supervision.progress import progress

        class SlowStore:
            def set(self, key, value): time.sleep(0.01)
            def add(self, key, delta): time.sleep(0.01); return delta

        class Group:
            group_name = "WORLD"
            store = SlowStore()
            _world = types.SimpleNamespace(process_index=0)

        g = Group()
        for seq in range(1, 50):
            progress.note(g, seq, None)
        time.sleep(0.1)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "STOPPED", out.stdout + out.stderr
