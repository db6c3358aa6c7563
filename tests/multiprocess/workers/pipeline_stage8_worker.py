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
``FSDP|EP|CP <name> ok``. Then stacked MoE stages through ``pipeline_value_and_grad`` (the
lockstep executor, one program over the 8 processes): pp = 2 x dp = 4, each dp process
routing its rows to the experts split over dp (test_ep_pipeline.py's), whose loss and
gradients must equal the un-pipelined model's; prints ``STACKED <name> ok``. A failure
raises, failing the launch. Usage: ``pipeline_stage8_worker.py RANK 8 PORT``.
"""

import datetime
import sys
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from pipeline_stage_cp_worker import run_context_parallel
from pipeline_stage_ep_worker import run_expert_parallel
from pipeline_stage_tp_worker import run_fully_sharded
from pipeline_stage_worker import B, S, V

import jaxpg


def _verify(name: str, cond: bool) -> None:
    if not cond:
        raise AssertionError(f"STACKED {name} failed on process {jax.process_index()}")
    print(f"STACKED {name} ok", flush=True)


def run_stacked_experts_over_dp() -> None:
    """``pipeline_value_and_grad`` over pp = 2 x dp = 4 processes, the experts over dp."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "expert_parallel"))
    from test_ep_pipeline import experts_over_dp

    mesh = jaxpg.init_device_mesh((2, 4), ("pp", "dp"))
    (loss, grads), (want, want_grads) = experts_over_dp(mesh)
    whole = jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh.jax_mesh, P()))
    got = [np.asarray(a.addressable_data(0)) for a in jax.tree.leaves(whole(grads))]
    ref = [np.asarray(a) for a in jax.tree.leaves(want_grads)]
    _verify("loss", np.allclose(float(loss), float(want), rtol=1e-5))
    _verify("grads", len(got) == len(ref) and all(
        g.shape == w.shape and np.allclose(g, w, rtol=1e-5, atol=1e-6)
        for g, w in zip(got, ref, strict=True)))
    w1 = grads.stages["moe"]["w1"]
    _verify("experts_split", w1.sharding.is_equivalent_to(
        NamedSharding(mesh.jax_mesh, P("pp", "dp")), w1.ndim))


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
                          np.random.default_rng(1), cp=4)),
                      ("stacked experts over dp", run_stacked_experts_over_dp)):
        start, cpu = time.perf_counter(), time.process_time()
        run()
        print(f"jaxpg {name} {time.perf_counter() - start:.1f} s "
              f"({time.process_time() - cpu:.1f} s CPU)", flush=True)
    jaxpg.destroy_process_group()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
