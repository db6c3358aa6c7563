"""A process whose peers may never come: ``init_process_group`` must raise a named error.

Usage: ``startup_worker.py INIT_METHOD RANK WORLD_SIZE TIMEOUT_S``. ``env://`` reads RANK
and WORLD_SIZE from the environment; ``store:HOST:PORT`` makes torch's
``TCPStore(HOST, PORT, WORLD_SIZE, is_master=RANK == 0)`` and passes it as ``store=``.
Prints ``RAISED after <s> s: <Type>: <message>`` (the seconds from the call, after jaxpg's
API has loaded) and exits 17 when a jaxpg error is raised, ``JOINED`` and exits 0 when
``init_process_group`` returns (it then leaves the world again).
"""

import datetime
import os
import sys
import time

import jaxpg

init_method, rank, world_size, seconds = sys.argv[1:5]
kwargs = {} if init_method == "env://" else {"rank": int(rank), "world_size": int(world_size)}
# the API binds on first use (importing jax, flax and optax, seconds on a loaded machine):
# bind it before the clock starts, so the time is init_process_group's own
jaxpg.init_process_group, jaxpg.TCPStore, jaxpg.DistError  # noqa: B018
start = time.monotonic()
timeout = datetime.timedelta(seconds=float(seconds))
try:
    if init_method.startswith("store:"):
        host, port = init_method.removeprefix("store:").rsplit(":", 1)
        store = jaxpg.TCPStore(host, int(port), int(world_size), is_master=rank == "0",
                               timeout=timeout)
        jaxpg.init_process_group("gloo", store=store, timeout=timeout, **kwargs)
    else:
        jaxpg.init_process_group("gloo", init_method=init_method, timeout=timeout, **kwargs)
except jaxpg.DistError as err:
    print(f"RAISED after {time.monotonic() - start:.1f} s: {type(err).__name__}: {err}",
          flush=True)
    os._exit(17)
print("JOINED", flush=True)
jaxpg.destroy_process_group()
