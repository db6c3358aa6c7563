"""Worker: exercises TCPStore across the processes of a jaxpg-run job.

Usage: ``jaxpg-run --nproc-per-node N tcp_store_worker.py ADDS``; every rank then
adds 1 to one counter ADDS times. Prints ``OK rank R`` at the end.
"""

import os
import sys
import time

from jaxpg.errors import DistStoreError
from jaxpg.rendezvous import initialize_jax_distributed, rendezvous, shutdown_jax_distributed
from jaxpg.stores import PrefixStore, TCPStore

adds = int(sys.argv[1])
info = rendezvous("env://", timeout=30)
store = initialize_jax_distributed(info, timeout=30, heartbeat_timeout=10)
assert isinstance(store, TCPStore), store
rank, world = info.rank, info.world_size
assert (rank, world) == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


def barrier(name: str) -> None:
    """A store-based barrier: the last to arrive releases the others."""
    if store.add(f"barrier/{name}", 1) == world:
        store.set(f"barrier/{name}/done", b"1")
    store.get(f"barrier/{name}/done")


barrier("start")

# set / get / wait / check / num_keys
if rank == 0:
    store.set("hello", "world")
assert store.get("hello") == b"world"
store.set(f"r{rank}", str(rank))
store.wait([f"r{r}" for r in range(world)])
assert store.check([f"r{r}" for r in range(world)])
assert not store.check(["never-set"])
assert store.multi_get([f"r{r}" for r in range(world)]) == [str(r).encode() for r in range(world)]
assert store.num_keys() >= world + 1

# A missing key times out with an error that names it.
store.set_timeout(0.3)
try:
    store.get("missing-key")
except DistStoreError as err:
    assert "missing-key" in str(err), err
else:
    raise AssertionError("get of a missing key did not time out")
store.set_timeout(30)

# add: a shared counter
store.add("counter", rank + 1)
barrier("counted")
assert store.get("counter") == str(world * (world + 1) // 2).encode()

# compare_set race: exactly one winner, and everyone sees the winner's value.
mine = f"rank{rank}".encode()
result = store.compare_set("leader", b"", mine)
store.set(f"won/{rank}", b"1" if result == mine else b"0")
barrier("raced")
wins = [store.get(f"won/{r}") for r in range(world)]
assert wins.count(b"1") == 1, wins
assert store.get("leader") == f"rank{wins.index(b'1')}".encode()
assert store.compare_set("absent", b"x", b"y") == b"x"  # torch: missing key gives expected
assert not store.check(["absent"])

# append race and prefix stores
for i in range(5):
    store.append("log", f"{rank}.{i};")
PrefixStore(f"p{rank}", store).set("k", b"v")
barrier("appended")
entries = store.get("log").decode().strip(";").split(";")
assert sorted(entries) == sorted(f"{r}.{i}" for r in range(world) for i in range(5)), entries
assert store.get(f"p{(rank + 1) % world}/k") == b"v"

# many adds on one key
start = time.perf_counter()
for _ in range(adds):
    store.add("many", 1)
elapsed = time.perf_counter() - start
barrier("added")
total = int(store.get("many"))
assert total == adds * world, (total, adds * world)
print(f"{adds} adds in {elapsed:.2f} s, total {total}", flush=True)

# delete_key
if rank == 0:
    assert store.delete_key("hello") is True
    assert store.delete_key("hello") is False
# jax sees one device per process, across the whole job.
import jax  # noqa: E402

assert jax.process_index() == rank and jax.process_count() == world
assert jax.local_device_count() == 1 and jax.device_count() == world, jax.devices()

barrier("end")
assert not store.check(["hello"])
print(f"OK rank {rank}", flush=True)
shutdown_jax_distributed()
