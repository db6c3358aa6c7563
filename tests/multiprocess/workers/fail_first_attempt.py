"""Worker: prints the launcher's variables; local rank 1 exits 3 on the first attempt."""

import json
import os
import sys

NAMES = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
         "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
         "TORCHELASTIC_RUN_ID", "JAXPG_COORDINATOR_HOSTED"]
print("ENV " + json.dumps({name: os.environ.get(name) for name in NAMES}), flush=True)
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["LOCAL_RANK"] == "1":
    sys.exit(3)
