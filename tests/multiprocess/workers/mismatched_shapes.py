"""Rank 0 all-reduces 1000 floats, rank 1 ten (with ``JAXPG_DEBUG=OFF``, no signature
check): gloo aborts rank 1
in C++ (``EnforceNotMet ... op.preamble.length <= op.nbytes. 1000 vs 12``, SIGABRT);
jaxpg-run must say why."""

import datetime

import numpy as np

import jaxpg

jaxpg.init_process_group(timeout=datetime.timedelta(seconds=60))
rank = jaxpg.get_rank()
print(f"rank {rank} calls all_reduce", flush=True)
out = jaxpg.all_reduce(np.ones(1000 if rank == 0 else 10, np.float32))
print("no error", out, flush=True)
