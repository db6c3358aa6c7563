"""Worker: prints the launcher's variables; local rank 1 exits 3 on the first attempt
(only on node argv[1] if given)."""

import json
import os
import sys
import time

NAMES = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
         "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
         "TORCHELASTIC_RUN_ID", "JAXPG_COORDINATOR_HOSTED"]
print("ENV " + json.dumps({name: os.environ.get(name) for name in NAMES}), flush=True)
node = sys.argv[1] if len(sys.argv) > 1 else os.environ["GROUP_RANK"]
if (os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["LOCAL_RANK"],
        os.environ["GROUP_RANK"]) == ("0", "1", node):
    sys.exit(3)
time.sleep(float(os.environ.get("SLEEP_S", "0")))
