"""from_hf and to_hf across 2 processes of 2 devices each (dp_shard=2 x tp=2; the MoE also
ep=2, its experts split across the processes). For each family saved by the test in
``argv[1]``: the logits of the loaded model equal transformers' (saved beside it), this
process read less than the checkpoint's bytes (its devices' blocks only), and the model is
written back to ``argv[1]/out/<family>`` by both processes. Prints ``CHECK <name> ok``."""

import os
import sys
from pathlib import Path

import jax
import numpy as np

import jaxpg
from jaxpg import models
from jaxpg.models import safetensors_io

FAMILIES = ("llama", "qwen3", "qwen3_moe")


def check(name, cond):
    if not cond:
        raise AssertionError(f"{name} failed on process {jax.process_index()}")
    print(f"CHECK {name} ok", flush=True)


def main():
    folder = Path(sys.argv[1])
    jaxpg.init_process_group()
    jaxpg.barrier()
    tokens = np.load(folder / "tokens.npy")
    read = safetensors_io.CheckpointReader.read
    counted = {"bytes": 0}

    def counting(self, name, index):
        out = read(self, name, index)
        counted["bytes"] += out.nbytes
        return out

    safetensors_io.CheckpointReader.read = counting
    for family in FAMILIES:
        path = folder / family
        total = sum(os.path.getsize(p) for p in path.glob("*.safetensors"))
        counted["bytes"] = 0
        degrees = dict(dp_shard=2, tp=2, ep=2 if family == "qwen3_moe" else 1)
        model = models.from_hf(str(path), dims=jaxpg.ParallelDims(**degrees))
        logits = np.asarray(model(tokens))
        want = np.load(folder / f"{family}_logits.npy")
        err = float(np.abs(logits - want).max())
        print(f"{family}: max |logits - transformers| = {err:.2e}; read "
              f"{counted['bytes']} of {total} bytes", flush=True)
        check(f"{family}_logits", logits.shape == want.shape and err <= 1e-4)
        check(f"{family}_reads_its_share", counted["bytes"] < 0.75 * total)
        models.to_hf(model, str(folder / "out" / family), max_shard_size="16KB")
        check(f"{family}_written", True)
    jaxpg.barrier()
    jaxpg.destroy_process_group()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
