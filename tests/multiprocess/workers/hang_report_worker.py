"""Worker: rank 1 sleeps before an all_reduce, so rank 0 waits in it for a while and prints
a hang line every ``JAXPG_HANG_REPORT_SECONDS`` (the test sets 1); then rank 1 arrives and
the call finishes with the right sum.

    hang_report_worker.py SLEEP_S
"""

import datetime
import sys
import time

import numpy as np

import jaxpg

sleep_s = float(sys.argv[1])
jaxpg.init_process_group(timeout=datetime.timedelta(seconds=60))
rank = jaxpg.get_rank()
_ = jaxpg.all_reduce(np.ones(2, np.float32))  # compiled here, before anyone waits
if rank == 1:
    time.sleep(sleep_s)
out = jaxpg.all_reduce(np.full(2, rank + 1.0, np.float32))
print(f"RESULT {np.asarray(out).tolist()}", flush=True)
jaxpg.destroy_process_group()
print("DONE", flush=True)
