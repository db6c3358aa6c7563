"""Under jaxpg-run: rank ``argv[1]`` never reaches init_process_group (it sleeps until the
launcher stops it); the others call it with an ``argv[2]``-second timeout."""

import datetime
import os
import sys
import time

import jaxpg

if os.environ["RANK"] == sys.argv[1]:
    time.sleep(600)
jaxpg.init_process_group(timeout=datetime.timedelta(seconds=float(sys.argv[2])))
print("JOINED", flush=True)
