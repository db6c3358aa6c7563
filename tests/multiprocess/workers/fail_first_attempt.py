"""Worker: prints the launcher's variables; local rank 1 (of node argv[2], if given) exits 3
on the first attempt, once every rank has printed (each touches SYNC_DIR/<attempt>-<rank>)."""

import json
import os
import sys
import time
from pathlib import Path

NAMES = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
         "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
         "TORCHELASTIC_RUN_ID", "JAXPG_COORDINATOR_HOSTED"]
print("ENV " + json.dumps({name: os.environ.get(name) for name in NAMES}), flush=True)
sync = Path(sys.argv[1])
attempt, world = os.environ["TORCHELASTIC_RESTART_COUNT"], int(os.environ["WORLD_SIZE"])
(sync / f"{attempt}-{os.environ['RANK']}").touch()
node = sys.argv[2] if len(sys.argv) > 2 else os.environ["GROUP_RANK"]
if (attempt, os.environ["LOCAL_RANK"], os.environ["GROUP_RANK"]) == ("0", "1", node):
    deadline = time.monotonic() + 60
    while len(list(sync.glob(f"{attempt}-*"))) < world and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(3)
time.sleep(float(os.environ.get("SLEEP_S", "0")))
