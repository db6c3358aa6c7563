"""Worker for --nnodes MIN:MAX: prints its variables; on the attempts before argv[1]
(default 1) it then waits (until the launcher stops it); on a later attempt it joins the
world, checks an all_reduce against the world size and exits 0."""

import json
import os
import time

NAMES = ["RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"]
print("ENV " + json.dumps({name: os.environ[name] for name in NAMES}), flush=True)
import sys  # noqa: E402

if int(os.environ["TORCHELASTIC_RESTART_COUNT"]) < int((sys.argv[1:] or ["1"])[0]):
    while True:
        time.sleep(1)

import jax.numpy as jnp  # noqa: E402

import jaxpg  # noqa: E402

jaxpg.init_process_group()
total = jaxpg.all_reduce(jnp.ones(()))
assert int(total) == jaxpg.get_world_size() == int(os.environ["WORLD_SIZE"]), total
jaxpg.destroy_process_group()
print(f"DONE world={int(total)}", flush=True)
