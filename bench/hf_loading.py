"""A loading process's peak host memory against its shard, for ``jaxpg.models.from_hf``.

Writes a synthetic Llama checkpoint (random bfloat16 weights, ``--layers`` x ``--d``,
sharded safetensors files with an index), then loads it with ``--nprocs`` processes of one
CPU device each on every layout of ``--layouts`` (``dp_shard=4`` and ``dp_shard=2,tp=2``
split every weight over 4 processes; ``dp_shard=1`` is one process holding the whole model).
Each process samples its anonymous and file-backed resident memory during the load
(``bench/_hf_loading_worker.py``) and reports the peaks above its memory before it, the
bytes its devices hold (its shard) and the bytes it read from the files. The anonymous
peak over the shard is the figure: 1 means the process held no more than its share.

    python bench/hf_loading.py                 # about 370 MB of weights
    python -m bench hf_loading --quick

Writes ``bench/results/hf_loading.json`` and prints a markdown table.
"""

import argparse
import datetime
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from _launch import RESULTS, launch

QUICK_ARGS = ["--layers", "2", "--d", "256", "--layouts", "dp_shard=1", "dp_shard=2"]


def write_checkpoint(folder: Path, layers: int, d: int, vocab: int) -> int:
    """A random bfloat16 Llama checkpoint in ~64 MB files; returns its tensor bytes."""
    import ml_dtypes
    from flax import nnx

    from jaxpg.models import CausalLM, LlamaConfig
    from jaxpg.models.hf_config import config_to_hf
    from jaxpg.models.hf_names import hf_tensors
    from jaxpg.models.layout import param_paths, value_of
    from jaxpg.models.safetensors_io import INDEX, StreamWriter

    config = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=4 * d,
                         num_layers=layers, num_heads=d // 64, num_kv_heads=max(1, d // 256))
    model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))
    entries = [(hf, shape) for path, var in param_paths(model).items()
               for hf, shape, _ in hf_tensors(path, tuple(value_of(var).shape))]
    bf16 = np.dtype(ml_dtypes.bfloat16)
    files, size = [[]], 0
    for hf, shape in entries:
        nbytes = int(np.prod(shape)) * 2
        if files[-1] and size + nbytes > 64 * 2**20:
            files.append([])
            size = 0
        files[-1].append((hf, shape))
        size += nbytes
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    weight_map = {}
    for i, members in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        writer = StreamWriter(str(folder / name), [(hf, s, bf16) for hf, s in members])
        for hf, shape in members:
            writer.write(hf, (0.02 * rng.standard_normal(shape, np.float32)).astype(bf16))
            weight_map[hf] = name
        writer.close()
    total = sum(int(np.prod(s)) * 2 for _, s in entries)
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                            "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config_to_hf(config, "bfloat16")))
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--layouts", nargs="+",
                   default=["dp_shard=1", "dp_shard=2", "dp_shard=4", "dp_shard=2,tp=2"])
    p.add_argument("--out", default=str(RESULTS / "hf_loading.json"))
    args = p.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="jaxpg-hf-bench-"))
    try:
        total = write_checkpoint(folder, args.layers, args.d, args.vocab)
        rows = []
        for layout in args.layouts:
            degrees = dict(kv.split("=") for kv in layout.split(","))
            nproc = int(np.prod([int(v) for v in degrees.values()]))
            run = launch(Path(__file__).parent / "_hf_loading_worker.py",
                         [str(folder), layout], nproc=nproc, timeout=900)
            for line in run.output.splitlines():
                if "RESULT " in line:
                    r = json.loads(line.split("RESULT ", 1)[1])
                    r.update(layout=layout, processes=nproc,
                             anon_over_shard=round(r["peak_anon_above_base"]
                                                   / r["held_bytes"], 3))
                    rows.append(r)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rows.sort(key=lambda r: (args.layouts.index(r["layout"]), r["process"]))
    result = {"suite": "hf_loading", "date": datetime.date.today().isoformat(),
              "checkpoint_bytes": total, "layers": args.layers, "d": args.d,
              "vocab": args.vocab, "dtype": "bfloat16", "cpu_count": os.cpu_count(),
              "load_average": os.getloadavg(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    mib = 2**20
    print(f"checkpoint: {total / mib:.1f} MiB (bfloat16)\n")
    print("| layout | process | shard held (MiB) | read (MiB) | peak anon above base (MiB) "
          "| anon / shard | peak file-backed (MiB) | s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['process']} | {r['held_bytes'] / mib:.1f} | "
              f"{r['read_bytes'] / mib:.1f} | {r['peak_anon_above_base'] / mib:.1f} | "
              f"{r['anon_over_shard']:.2f} | {r['peak_file_above_base'] / mib:.1f} | "
              f"{r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
