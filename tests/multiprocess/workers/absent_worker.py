"""Rank 1 never reaches the second all_reduce (it sleeps, or dies); rank 0 must raise a
DistError naming it (DistTimeoutError after the group's 3 s timeout, or DistNetworkError as
soon as gloo sees the connection drop), and then exits 17.

The world starts with a generous timeout (a loaded machine may take long to start both
processes); the collective that rank 1 misses runs on a group of both ranks with the
short one. Rank 1 stays away until rank 0 has raised (rank 0 writes the file argv[2]), so
that on a loaded machine rank 0 sees the timeout, never rank 1's exit instead."""

import datetime
import os
import sys
import time
from pathlib import Path

import numpy as np

import jaxpg

jaxpg.init_process_group(timeout=datetime.timedelta(seconds=120))
both = jaxpg.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
jaxpg.all_reduce(np.ones(2, np.float32))
if jaxpg.get_rank() == 1:
    if sys.argv[1] == "killed":
        os._exit(9)
    raised, deadline = Path(sys.argv[2]), time.monotonic() + 80
    while not raised.exists() and time.monotonic() < deadline:  # a handshake, not a guess
        time.sleep(0.05)
    os._exit(0)
start = time.monotonic()
try:
    jaxpg.all_reduce(np.ones(2, np.float32), group=both)
except jaxpg.DistError as err:
    print(f"raised after {time.monotonic() - start:.2f} s: {type(err).__name__}: {err}", flush=True)
    Path(sys.argv[2]).touch()
    os._exit(17)
print("no error", flush=True)
os._exit(1)
