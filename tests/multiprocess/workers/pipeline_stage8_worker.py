"""PipelineStages whose group splits the data, across 8 processes (one launch), each against
the un-pipelined model on the whole batch:

* fully sharded stages, pp = 2 x dp_shard = 4 (pipeline_stage_tp_worker.py's two unequal
  stages, the parameters split four ways, each process a quarter of the batch);
* expert-parallel stages, pp = 4 x ep = 2: four unequal stages (an embedding and an MoE
  layer, two MoE blocks, an MoE layer, a norm and a head), so two of them only receive and
  send, under 4 microbatches (pipeline_stage_ep_worker.py's);
* context-parallel stages, pp = 2 x cp = 4 (ring attention, each process a quarter of every
  sequence: pipeline_stage_cp_worker.py's).

Each runs a ``Schedule1F1B`` step, an SGD step and a ``ScheduleGPipe`` step; the checks print
``FSDP|EP|CP <name> ok`` (a failure raises, failing the launch). Usage:
``pipeline_stage8_worker.py RANK 8 PORT``.
"""

import datetime
import sys
import time

import numpy as np
from pipeline_stage_cp_worker import run_context_parallel
from pipeline_stage_ep_worker import run_expert_parallel
from pipeline_stage_tp_worker import run_fully_sharded
from pipeline_stage_worker import B, S, V

import jaxpg


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    jaxpg.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=world, timeout=datetime.timedelta(seconds=300))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, V, size=(B, S)).astype(np.int32)
    labels = rng.integers(0, V, size=(B, S)).astype(np.int32)
    for name, run in (("fully sharded", lambda: run_fully_sharded(tokens, labels, k=4)),
                      ("expert parallel", lambda: run_expert_parallel(
                          np.random.default_rng(2), pp=4, ep=2, m=4)),
                      ("context parallel", lambda: run_context_parallel(
                          np.random.default_rng(1), cp=4))):
        start, cpu = time.perf_counter(), time.process_time()
        run()
        print(f"jaxpg {name} {time.perf_counter() - start:.1f} s "
              f"({time.process_time() - cpu:.1f} s CPU)", flush=True)
    jaxpg.destroy_process_group()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
