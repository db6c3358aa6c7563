"""Worker: draws a progress line with carriage returns; each redraw waits for an ack file.

Rank 0 draws ``\\rstep K`` for K = 0, 1, 2 and waits (at most 30 s) for ``ACK_DIR/K`` before
the next redraw, so the run only succeeds if every redraw reached the reader while the
worker was still drawing. The other ranks print one line each to stdout and stderr.
"""

import os
import sys
import time

ack_dir = sys.argv[1]
if os.environ["RANK"] != "0":
    print(f"hello from rank {os.environ['RANK']}")
    print("to stderr", file=sys.stderr)
    sys.exit(0)
for k in range(3):
    sys.stdout.write(f"\rstep {k}")
    sys.stdout.flush()
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(ack_dir, str(k))):
        if time.monotonic() > deadline:
            sys.exit(f"redraw {k} was not seen by the reader within 30 s")
        time.sleep(0.02)
sys.stdout.write("\rdone\n")
