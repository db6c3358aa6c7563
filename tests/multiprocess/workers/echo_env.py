"""Worker: prints the launcher's environment variables, on stdout and stderr."""

import json
import os
import sys

NAMES = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "XLA_FLAGS",
    "PYTHONUNBUFFERED",
    "JAXPG_DEVICES_PER_PROC",
    "CUDA_VISIBLE_DEVICES",
]

print("ENV " + json.dumps({name: os.environ.get(name) for name in NAMES}))
print("ARGS " + json.dumps(sys.argv[1:]))
print("to stderr", file=sys.stderr)
print("no newline at the end", end="")
