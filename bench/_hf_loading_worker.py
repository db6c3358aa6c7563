"""One process of ``bench/hf_loading.py``: loads the checkpoint in ``argv[1]`` with
``jaxpg.models.from_hf`` on the layout ``argv[2]`` (``dp_shard=2,tp=2``), sampling its own
anonymous and file-backed resident memory every 2 ms during the load, and prints one
``RESULT {json}`` line: the peaks above the memory before the load, the bytes its devices
hold, the bytes it read from the files."""

import json
import os
import sys
import threading
import time

import jax

import jaxpg
from jaxpg import models
from jaxpg.models import safetensors_io


def resident() -> dict[str, int]:
    """This process's RssAnon and RssFile, bytes (/proc/self/status)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def main() -> None:
    folder, layout = sys.argv[1], sys.argv[2]
    degrees = {k: int(v) for k, v in (p.split("=") for p in layout.split(","))}
    jaxpg.init_process_group()
    dims = jaxpg.ParallelDims(**degrees)
    dims.device_mesh  # noqa: B018  (built before the baseline)
    read = safetensors_io.CheckpointReader.read
    counted = {"bytes": 0}

    def counting(self, name, index):
        out = read(self, name, index)
        counted["bytes"] += out.nbytes
        return out

    safetensors_io.CheckpointReader.read = counting
    jaxpg.barrier()
    base = resident()
    peak = dict(base)
    done = threading.Event()

    def sample():
        while not done.is_set():
            now = resident()
            for k in peak:
                peak[k] = max(peak[k], now[k])
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    model = models.from_hf(folder, dims=dims, dtype=jax.numpy.bfloat16)
    jax.block_until_ready(jax.tree.leaves(jaxpg.models.layout.param_paths(model)))
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
    after = resident()
    for k in peak:
        peak[k] = max(peak[k], after[k])
    held = sum(s.data.nbytes for v in models.layout.param_paths(model).values()
               for s in v.get_value().addressable_shards)
    print("RESULT " + json.dumps({
        "process": jax.process_index(), "devices": jax.local_device_count(),
        "held_bytes": held, "read_bytes": counted["bytes"], "seconds": round(seconds, 3),
        "peak_anon_above_base": peak["RssAnon"] - base["RssAnon"],
        "peak_file_above_base": peak["RssFile"] - base["RssFile"],
        "anon_after_above_base": after["RssAnon"] - base["RssAnon"]}), flush=True)
    jaxpg.barrier()
    jaxpg.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
