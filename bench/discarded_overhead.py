"""What the discarded-result check (``jaxpg/collectives/discarded.py``) adds to an eager call.

One process, one CPU device, ``jaxpg.all_reduce`` of 4 floats (the smallest call, where a
fixed cost shows most): the public function (with the check) against the same function
without it (``__wrapped__``), and ``check_input`` alone, in ``--rounds`` short rounds of
``--calls`` calls whose order rotates (``bench/_rounds.py``); the figure is the median over
rounds of the per-call difference.

    flock /tmp/jaxpg-bench.lock python bench/discarded_overhead.py

Writes ``bench/results/discarded_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the shared helpers

import jax.numpy as jnp  # noqa: E402
from _launch import RESULTS  # noqa: E402
from _rounds import block, diff_median, no_wait, run_rounds  # noqa: E402

import jaxpg  # noqa: E402
from jaxpg.collectives._dispatch import check_input  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=61)
    p.add_argument("--calls", type=int, default=300, help="calls per variant and round")
    p.add_argument("--out", default=str(RESULTS / "discarded_overhead.json"))
    args = p.parse_args()
    jaxpg.init_process_group()
    x = jnp.ones(4)
    variants = {"checked": lambda: jaxpg.all_reduce(x),
                "unchecked": lambda: jaxpg.all_reduce.__wrapped__(x),
                "check_input": lambda: check_input(x, "all_reduce")}
    # 500 warm-up calls each (compile); short rounds: load hits every variant alike. The
    # host's cost of a call is what is timed: no call is waited for inside the timing
    timed = run_rounds(variants, args.rounds, iters=args.calls, warmup=500, wait=no_wait,
                       settle=block)
    us = {k: [t * 1e6 for t in v] for k, v in timed.wall.items()}
    record = {
        "command": "python bench/discarded_overhead.py " + " ".join(sys.argv[1:]),
        **timed.loads(),
        "all_reduce_us_median": {k: v * 1e6 for k, v in timed.medians().items()},
        "check_overhead_us_median": diff_median(us["checked"], us["unchecked"]),
        "rounds": args.rounds,
        "calls_per_round": args.calls,
    }
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(json.dumps({k: record[k] for k in ("all_reduce_us_median",
                                             "check_overhead_us_median")}, indent=1))


# python -m bench discarded_overhead --quick: a short run, written under /tmp unless --out is given
QUICK_ARGS = ["--rounds", "5"]

if __name__ == "__main__":
    main()
