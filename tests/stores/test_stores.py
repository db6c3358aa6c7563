"""HashStore, FileStore and PrefixStore in one process: torch's semantics, threads."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jaxpg.errors import DistStoreError
from jaxpg.stores import FileStore, HashStore, PrefixStore, Store

WORKERS = Path(__file__).parent.parent / "multiprocess" / "workers"


@pytest.fixture(params=["hash", "file", "prefix-hash", "prefix-file"])
def store(request, tmp_path) -> Store:
    kind = request.param
    base: Store = FileStore(tmp_path / "store") if "file" in kind else HashStore()
    base.set_timeout(5)
    return PrefixStore("pg0", base) if kind.startswith("prefix") else base


def test_set_get_bytes_and_str(store):
    store.set("a", b"\x00\xff")
    store.set("b", "text")
    assert store.get("a") == b"\x00\xff"
    assert store.get("b") == b"text"
    store.set("a", b"")
    assert store.get("a") == b""


def test_get_timeout_names_key_and_timeout(store):
    store.set_timeout(datetime.timedelta(milliseconds=100))
    assert store.timeout == datetime.timedelta(milliseconds=100)
    start = time.monotonic()
    with pytest.raises(DistStoreError, match=r"missing-key.*0\.1 s|0\.1 s.*missing-key"):
        store.get("missing-key")
    assert 0.09 <= time.monotonic() - start < 3  # it waited out the timeout it was given


def test_get_waits_for_a_later_set(store):
    threading.Timer(0.1, store.set, args=("late", b"1")).start()
    assert store.get("late") == b"1"


def test_add_is_a_decimal_counter(store):
    assert store.add("n", 5) == 5
    assert store.add("n", -7) == -2
    assert store.get("n") == b"-2"
    store.set("m", "40")
    assert store.add("m", 2) == 42
    store.set("text", "abc")
    with pytest.raises(DistStoreError, match="abc"):
        store.add("text", 1)
    with pytest.raises(TypeError, match="amount"):
        store.add("n", 1.5)


def test_compare_set_follows_torch(store):
    # Missing key, non-empty expected: nothing written, expected returned.
    assert store.compare_set("k", b"x", b"y") == b"x"
    assert not store.check(["k"])
    # Missing key, empty expected: created.
    assert store.compare_set("k", b"", b"first") == b"first"
    # Matching value: replaced.
    assert store.compare_set("k", "first", "second") == b"second"
    # Mismatch: current value returned, nothing written.
    assert store.compare_set("k", b"first", b"third") == b"second"
    assert store.get("k") == b"second"


def test_wait_check_delete_num_keys(store):
    store.set("x", b"1")
    store.wait(["x"])
    store.wait(["x"], timeout=0.05)
    with pytest.raises(DistStoreError, match=r"y' *\."):
        store.wait(["x", "y"], timeout=0.05)
    assert store.check(["x"]) and not store.check(["x", "y"])
    before = store.num_keys()
    store.set("y", b"2")
    assert store.num_keys() == before + 1
    assert store.delete_key("y") is True
    assert store.delete_key("y") is False
    assert store.num_keys() == before


def test_multi_get_multi_set_append(store):
    store.multi_set(["p", "q"], [b"1", "2"])
    assert store.multi_get(["q", "p"]) == [b"2", b"1"]
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        store.multi_set(["p", "q"], [b"1"])
    store.append("log", b"a")
    store.append("log", "b")
    assert store.get("log") == b"ab"


def test_bad_arguments_raise_naming_them(store):
    with pytest.raises(TypeError, match="key=1"):
        store.set(1, b"v")
    with pytest.raises(TypeError, match="value=3"):
        store.set("k", 3)
    with pytest.raises(TypeError, match="did you mean"):
        store.check("k")
    with pytest.raises(ValueError, match="timeout=-1"):
        store.set_timeout(-1)
    with pytest.raises(TypeError, match="timeout='5'"):
        store.set_timeout("5")


def test_threads_add_and_race_compare_set(store):
    winners: list[int] = []

    def work(i: int) -> None:
        for _ in range(100):
            store.add("count", 1)
        if store.compare_set("leader", b"", str(i)) == str(i).encode():
            winners.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert store.get("count") == b"800"
    assert len(winners) == 1 and store.get("leader") == str(winners[0]).encode()


def test_prefix_store_prefixes_keys():
    base = HashStore()
    prefixed = PrefixStore("grp", base)
    prefixed.set("k", b"v")
    assert base.get("grp/k") == b"v"
    assert PrefixStore("inner", prefixed).add("c", 2) == 2
    assert base.get("grp/inner/c") == b"2"
    assert prefixed.underlying_store is base and prefixed.prefix == "grp"
    prefixed.set_timeout(7)
    assert base.timeout == datetime.timedelta(seconds=7)
    with pytest.raises(TypeError, match="store="):
        PrefixStore("x", {})


def test_file_store_instances_share_the_file(tmp_path):
    path = tmp_path / "shared"
    a, b = FileStore(path), FileStore(str(path))
    a.set("k", b"v")
    assert b.get("k") == b"v"
    assert b.add("n", 2) == 2 and a.add("n", 3) == 5
    assert b.delete_key("k") and not a.check(["k"])
    assert a.num_keys() == b.num_keys() == 1


def test_file_store_world_size_and_cleanup(tmp_path):
    path = tmp_path / "two"
    with pytest.raises(ValueError, match="world_size=0"):
        FileStore(path, world_size=0)
    first, second = FileStore(path, world_size=2), FileStore(path, world_size=2)
    with pytest.raises(ValueError, match="previous run"):
        FileStore(path, world_size=2)
    first.close()
    assert path.exists()
    second.close()
    assert not path.exists()
    with pytest.raises(ValueError, match="closed"):
        first.get("k")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_file_store_four_processes_add_and_race(tmp_path):
    path, procs, adds = tmp_path / "mp", 4, 1000
    store = FileStore(path, timeout=20)
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKERS / "file_store_adder.py"), str(path), str(adds)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        for _ in range(procs)
    ]
    try:
        store.wait(["ready"])
        while int(store.get("ready")) < procs:
            time.sleep(0.01)
        store.set("go", b"1")
        outputs = [w.communicate(timeout=45)[0].split() for w in workers]
    finally:
        for w in workers:
            w.kill()
    assert [w.returncode for w in workers] == [0] * procs
    assert store.get("count") == str(procs * adds).encode()
    results = sorted(o[-1] for o in outputs)
    assert results == ["LOST"] * (procs - 1) + ["WON"]
