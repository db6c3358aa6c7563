"""Worker: the rank given as argv[1] exits with code argv[2]; the others sleep."""

import os
import sys
import time

failing_rank, code = int(sys.argv[1]), int(sys.argv[2])
rank = int(os.environ["RANK"])
print(f"started pid={os.getpid()}", flush=True)
if rank == failing_rank:
    time.sleep(0.5)
    sys.exit(code)
time.sleep(60)
print("still alive after 60 s")
