"""What the discarded-result check (``jaxpg/collectives/discarded.py``) adds to an eager call.

One process, one CPU device, ``jaxpg.all_reduce`` of 4 floats (the smallest call, where a
fixed cost shows most): the public function (with the check) against the same function
without it (``__wrapped__``), and ``check_input`` alone, in 61 short rounds of 300 calls
whose order alternates; the figure is the median over rounds of the per-call difference.

    flock /tmp/jaxpg-bench.lock python bench/discarded_overhead.py

Writes ``bench/results/discarded_overhead.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax.numpy as jnp  # noqa: E402

import jaxpg  # noqa: E402
from jaxpg.collectives._dispatch import check_input  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _per_call_us(fn, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    load_before = os.getloadavg()
    jaxpg.init_process_group()
    x = jnp.ones(4)
    variants = {"checked": lambda: jaxpg.all_reduce(x),
                "unchecked": lambda: jaxpg.all_reduce.__wrapped__(x),
                "check_input": lambda: check_input(x, "all_reduce")}
    for fn in variants.values():  # compile, warm up
        _per_call_us(fn, 500)
    rounds = []
    for r in range(61):  # short rounds, the order alternating: load hits both alike
        names = ["checked", "unchecked"] if r % 2 else ["unchecked", "checked"]
        timed = {name: _per_call_us(variants[name], 300) for name in names}
        timed["check_input"] = _per_call_us(variants["check_input"], 300)
        rounds.append(timed)
    record = {
        "command": "python bench/discarded_overhead.py",
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "all_reduce_us_median": {k: statistics.median(r[k] for r in rounds)
                                 for k in rounds[0]},
        "check_overhead_us_median": statistics.median(r["checked"] - r["unchecked"]
                                                      for r in rounds),
        "rounds": len(rounds),
        "calls_per_round": 300,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "discarded_overhead.json").write_text(json.dumps(record, indent=2))
    print(json.dumps({k: record[k] for k in ("all_reduce_us_median",
                                             "check_overhead_us_median")}, indent=1))


if __name__ == "__main__":
    main()
