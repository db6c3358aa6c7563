"""Worker: ``rendezvous_worker.py INIT_METHOD``, run by jaxpg-run.

Meets through INIT_METHOD (``{port}`` is replaced by MASTER_PORT) with rank and
world size from the launcher, starts jax.distributed, counts arrivals in the
returned store and checks that JAX sees every process. Prints ``OK rank R``.
With INIT_METHOD ``tcpstore``, a torch-style ``TCPStore(host, port, world_size,
is_master)`` starts jax.distributed instead.
"""

import os
import sys

from jaxpg.rendezvous import initialize_jax_distributed, rendezvous, shutdown_jax_distributed
from jaxpg.stores import TCPStore

init_method = sys.argv[1].replace("{port}", os.environ["MASTER_PORT"])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if init_method == "tcpstore":
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = TCPStore(host, port, world, is_master=rank == 0, timeout=30)
    address = f"{store.host}:{store.port}"
    assert address == f"{host}:{port}", address
else:
    info = rendezvous(init_method, rank=rank, world_size=world, timeout=30)
    store = initialize_jax_distributed(info, timeout=30, heartbeat_timeout=10)
    address = info.coordinator_address
print(f"coordinator {address} store {type(store).__name__}", flush=True)
if store.add("arrived", 1) == world:
    store.set("all-arrived", b"1")
store.wait(["all-arrived"])
if init_method == "tcpstore":  # Another TCPStore on the running service sees the same keys.
    assert TCPStore(host, port).get("all-arrived") == b"1"

import jax  # noqa: E402

assert jax.process_index() == rank and jax.device_count() == world, jax.devices()
if store.add("done", 1) == world:
    store.set("all-done", b"1")
store.wait(["all-done"])
store.close()  # A FileStore's file goes away after the last close.
print(f"OK rank {rank}", flush=True)
shutdown_jax_distributed()
