"""Worker: says it started, then sleeps for a minute."""

import os
import time

print(f"started pid={os.getpid()}", flush=True)
time.sleep(60)
print("still alive after 60 s")
