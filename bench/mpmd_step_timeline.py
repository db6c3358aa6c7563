"""Where a process-executor step's time goes, action by action: run under
``python -m jaxpg.run --nproc-per-node 2``, one process per pipeline rank, each pinned to
its own core, the model of ``bench/pipeline_vs_torch.py`` (4 residual MLP blocks of width
512, one dict of arrays per block; m = 8 microbatches of 32 rows).

Each rank prints its median step (10 steps, between barriers), then, over 5 steps recorded
with ``jaxpg.pipeline.process.step_timeline``: its per-step totals (``summarize``) and the median
span of each kind of event (``compute`` split into forward ``F`` and backward ``B``
actions, the lanes' ``send`` and ``recv``, the host's ``wait``); and the host's own Python
time per step over 10 steps under ``cProfile`` (the time not spent waiting on a lock), and
the CPU time of the lanes' transfer threads (``jaxpg-collective``) over the same steps.

    python -m jaxpg.run --nproc-per-node 2 bench/mpmd_step_timeline.py [1f1b]
"""

from __future__ import annotations

import collections
import cProfile
import os
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.sched_setaffinity(0, {int(os.environ.get("LOCAL_RANK", "0")) % os.cpu_count()})
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the shared helpers

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _pipeline_mp_worker import jaxpg_step, make_batch, make_params, staged  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpg  # noqa: E402
from jaxpg.pipeline import get_schedule  # noqa: E402
from jaxpg.pipeline.process.step_timeline import record_timeline, summarize  # noqa: E402
from jaxpg.pipeline.stage.order import to_rank_order  # noqa: E402


def lane_cpu_s() -> float:
    """CPU seconds so far of this process's ``jaxpg-collective`` threads (the lanes')."""
    ids = {str(t.native_id) for t in threading.enumerate() if t.name == "jaxpg-collective"}
    total = 0
    for tid in ids:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "1f1b"
    jaxpg.init_process_group()
    rank, p, m, blocks = jax.process_index(), jax.process_count(), 8, 4
    mesh = Mesh(np.array(jax.devices()), ("pp",))
    x, t = make_batch(m * 32, 512)
    gx, gt = (jax.device_put(a, NamedSharding(mesh, P())) for a in (x, t))
    tt = get_schedule(name, p, m, 1)
    params = jax.device_put(to_rank_order(staged(make_params(blocks, 512), p), tt),
                            NamedSharding(mesh, P("pp")))  # fmt: skip
    step = jaxpg_step(name, mesh, m, blocks // p, stage_order="rank", executor="mpmd")

    def run(n: int) -> list[float]:
        walls = []
        for _ in range(n):
            jaxpg.barrier()
            t0 = time.perf_counter()
            jax.block_until_ready(step(params, gx, gt))
            walls.append(time.perf_counter() - t0)
        return walls

    run(3)
    walls = run(10)
    with record_timeline() as tl:
        run(5)
    rows = summarize(tl.events)
    spans = collections.defaultdict(list)
    for e in tl.events:
        spans[e.kind + (e.label[:1] if e.kind == "compute" else "")].append(e.end - e.start)
    lanes_before = lane_cpu_s()
    profile = cProfile.Profile()
    profile.enable()
    run(10)
    profile.disable()
    lanes_ms = 1e3 * (lane_cpu_s() - lanes_before) / 10
    stats = pstats.Stats(profile)
    waiting = sum(tt_ for (_, _, fn), (_, _, tt_, _, _) in stats.stats.items()
                  if "acquire" in fn or "block_until_ready" in fn)
    python_ms = 1e3 * (stats.total_tt - waiting) / 10
    print(f"rank {rank}: step {1e3 * statistics.median(walls):.1f} ms; per step: "
          + ", ".join(f"{k} {1e3 * statistics.median(r[k] for r in rows):.1f} ms"
                      for k in rows[0] if k != "actions")
          + "; median spans: "
          + ", ".join(f"{k} {1e3 * statistics.median(v):.2f} ms (x{len(v) // 5})"
                      for k, v in sorted(spans.items()))
          + f"; host Python {python_ms:.1f} ms a step; the transfer threads' CPU "
          f"{lanes_ms:.1f} ms a step", flush=True)
    jaxpg.destroy_process_group()


# python -m bench mpmd_step_timeline: one process per pipeline rank, under the launcher
LAUNCH_ARGS = ["--nproc-per-node", "2"]

if __name__ == "__main__":
    main()
