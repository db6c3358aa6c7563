"""Worker under jaxpg-run: init, all_reduce, destroy, and again; prints RESULT and HOSTED."""

import os

import numpy as np

import jaxpg

print(f"HOSTED {os.environ.get('JAXPG_COORDINATOR_HOSTED')}", flush=True)
rank = int(os.environ["RANK"])
for attempt in range(2):
    jaxpg.init_process_group()
    out = np.asarray(jaxpg.all_reduce(np.full(2, rank + attempt, np.float32)))
    print(f"RESULT {attempt} {out.tolist()}", flush=True)
    jaxpg.destroy_process_group()
