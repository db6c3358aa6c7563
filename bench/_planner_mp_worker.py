"""One worker of ``python -m bench planner --processes N`` (started by ``jaxpg.run``; not
run by hand).

The 8 devices of the job are split over N processes (``--devices-per-proc 8 / N``), which
the planner sees as N nodes: ``devices_per_node`` is a process's devices, the link between
processes (gloo over loopback) the ``inter`` link. Every process:

1. reads the devices' profile the launching process calibrated on as many of its own
   devices as a worker has (``--hardware``: compute rates and a kernel's fixed cost, which
   a process inside a multi-process CPU world measures far above what its steps pay:
   docs/planner.md, "Across processes"), and measures inside the world the link within a
   process (:func:`jaxpg.plan.calibrate.calibrate_link` over its own devices, every
   process at once: such a collective costs more there than in a lone process) and, with
   the other processes, the link between them (over the world's devices); the first
   process's figures are every process's;
2. compiles each layout's training step over the world's devices
   (:func:`jaxpg.plan.trial.compile_trial`) and times them in rounds, one step of each
   layout a round, each process by its own CPU seconds over its devices;
3. a layout's measured step is, per round, the slowest process's, and then the fastest
   round.

Rank 0 writes the rows and their summary to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

import jax
from _planner_cases import MODELS, MP_LAYOUTS, summary, time_in_rounds

import jaxpg
from jaxpg.plan import Job, Layout, evaluate
from jaxpg.plan.calibrate import calibrate_link
from jaxpg.plan.hardware import load_hardware
from jaxpg.plan.trial import compile_trial


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(MODELS), default="gpt")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("--hardware", type=pathlib.Path, required=True,
                   help="the devices' profile, calibrated by the launching process")
    args = p.parse_args()
    jaxpg.init_process_group()
    local = jax.local_devices()
    # the devices' rates come from the launching process (--hardware); both links are
    # measured here, inside the world (a process's own devices pay more per collective
    # there than alone), by every process at once, the first process's figures kept
    hw = load_hardware(args.hardware)
    intra = calibrate_link(devices=local, repeats=3)
    inter = calibrate_link(devices=jax.devices(), repeats=3)
    intra, inter = jaxpg.broadcast_object_list([intra, inter], src=0, allow_pickle=True)
    hw = dataclasses.replace(hw, intra=intra, inter=inter, devices_per_node=len(local))
    model, _ = MODELS[args.model]
    layouts = MP_LAYOUTS[args.model][:4] if args.quick else MP_LAYOUTS[args.model]
    job = Job(model=model, devices=len(jax.devices()), hardware=hw, seq_len=128,
              global_batch=16, dtype="fp32", param_dtype="fp32")
    chosen = [Layout.parse(text) for text in layouts]
    trials = [compile_trial(job, lay, devices=jax.devices()) for lay in chosen]
    samples = time_in_rounds(trials, args.rounds)
    # this process's CPU seconds over its devices, per layout and round; then every
    # process's (a process holds several ranks: its list comes once per rank)
    mine = [[cpu / len(local) for _, cpu in taken] for taken in samples]
    everyone = jaxpg.all_gather_object({"process": jax.process_index(), "cpu": mine},
                                       allow_pickle=True)
    by_process = {e["process"]: e["cpu"] for e in everyone}
    rows = []
    for i, (lay, trial) in enumerate(zip(chosen, trials)):
        est = evaluate(lay, job)
        slowest = [max(cpu[i][r] for cpu in by_process.values()) for r in range(args.rounds)]
        rows.append({"layout": str(lay), "predicted_s": est.step_s, "measured_s": min(slowest),
                     "measured_slowest_process_s": slowest,
                     "measured_wall_s": [wall for wall, _ in samples[i]],
                     "comm_s": dict(est.time.comm),
                     "compiled_peak_mib": trial.memory.peak / 2**20,
                     "predicted_memory_mib": est.memory.total_gib * 1024})
        if jax.process_index() == 0:
            print(f"{str(lay):<60} predicted {est.step_s:7.3f} s  measured "
                  f"{min(slowest):7.3f} s", flush=True)
    if jax.process_index() == 0:
        result = {"processes": jax.process_count(), "devices_per_process": len(local),
                  "calibrated": hw.to_dict(), "model": model.describe(),
                  "seq_len": job.seq_len, "global_batch": job.global_batch,
                  "rounds": args.rounds, "layouts": rows,
                  "measured": "per round the slowest process's CPU seconds over its devices; "
                              "then the fastest round",
                  **summary(rows)}
        args.out.write_text(json.dumps(result, indent=1))
    jaxpg.destroy_process_group()


if __name__ == "__main__":
    main()
