"""Per-rank memory of DDP and ZeRO stages 1-3 for a 110M-parameter GPT, from XLA's memory
analysis of the compiled step (nothing is allocated: the models are ``nnx.eval_shape``
structs and the steps are only compiled).

For N = 2, 4 and 8 simulated CPU devices in one process, and each of DDP, ZeRO-1 on DDP
(``zero_stage=1``), FSDP stage 1, 2, 3 (``reshard_after_forward`` True and
False), the table gives one rank's bytes of

* parameters, gradients and optimizer state (Adam: two moments), ZeRO's accounting: the
  stored state read from the arrays' shardings, the gradients as the update reads them;
* ``temp``: XLA's temporary buffers of the step (the gradients before reduction, the
  gathered units, the activations, the update's temporaries);
* ``peak``: arguments + outputs - donated + temp, the step's footprint.

Stage 3 gathers each block, the embedding and the head as units (torchtitan's wrapping);
the root holds the position table and the final LayerNorm. It then compiles stage 3 at
depth 12 and 24 to show that the peak grows with depth only by the sharded state and the
activations, not by the gathered units. The batch is small (2 sequences of 128 tokens per
rank) so that parameters dominate.

    flock /tmp/jaxpg-bench.lock python bench/fsdp_memory.py      # about 10 minutes

Writes ``bench/results/fsdp_memory.json`` and ``.png`` and prints markdown tables
(``--plot-only`` redraws the PNG from the JSON).
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from _transformer import GPT, SEQ, VOCAB, Block, loss_fn, n_params  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpg  # noqa: E402
from jaxpg.data_parallel.leaf_split import make_leaf_splits  # noqa: E402
from jaxpg.data_parallel.zero import abstract_sharded_opt_state  # noqa: E402
from jaxpg.ddp import bucket_plan, comm_hooks  # noqa: E402
from jaxpg.ddp.train_step import StepMode, ZeroSharding, build_train_step  # noqa: E402
from jaxpg.fsdp import FullyShardedDataParallel  # noqa: E402
from jaxpg.fsdp.memory import StepMemory, state_bytes, step_memory  # noqa: E402

RESULTS = Path(__file__).parent / "results"
PER_RANK = 2
MIB = 2**20


def _structs(tree, sharding):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        tree)


def ddp_memory(model, optimizer, group, batch, *, zero: bool) -> StepMemory:
    """DDP's (or ZeRO-1 on DDP's) step compiled from shapes: replicated parameters."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    mesh = group.mesh
    replicated = NamedSharding(mesh, P())
    params = _structs(params, replicated)
    rest = _structs(rest, replicated)
    plan = bucket_plan.make_bucket_plan(params)
    zero_sharding = None
    if zero:
        layouts = make_leaf_splits(params, group.size())
        opt, shardings = abstract_sharded_opt_state(optimizer, params, layouts, mesh,
                                                    (group.axis_name,), params_padded=False)
        zero_sharding = ZeroSharding(layouts=layouts, mesh=mesh, axes=(group.axis_name,),
                                     opt_shardings=shardings)
    else:
        opt = _structs(jax.eval_shape(optimizer.init, params), replicated)
    hook, _ = comm_hooks.make_comm_hook("allreduce")
    step = build_train_step(loss_fn, graphdef=graphdef, optimizer=optimizer, plan=plan,
                            comm_hook=hook, pg=group, mode=StepMode(), zero=zero_sharding)
    tokens = jax.ShapeDtypeStruct((batch * group.size(), SEQ + 1), jnp.int32,
                                  sharding=NamedSharding(mesh, P(group.axis_name)))
    ma = step.lower(params, rest, opt, None, None, {"tokens": tokens},
                    None).compile().memory_analysis()
    return StepMemory(params=state_bytes(params), opt_state=state_bytes(opt),
                      grads=state_bytes(params), arguments=ma.argument_size_in_bytes,
                      outputs=ma.output_size_in_bytes, aliased=ma.alias_size_in_bytes,
                      temp=ma.temp_size_in_bytes)


def fsdp_memory(model, optimizer, group, batch, **kwargs) -> StepMemory:
    fsdp = FullyShardedDataParallel(model, optimizer, group=group, **kwargs)
    tokens = jax.ShapeDtypeStruct((batch * group.size(), SEQ + 1), jnp.int32)
    return step_memory(fsdp, loss_fn, {"tokens": tokens})


def units(path, module):
    """Every block, and the embedding and the head on their own (torchtitan's wrapping)."""
    return isinstance(module, Block) or path in ("embed", "head")


VARIANTS = {
    "ddp": lambda m, o, g, b: ddp_memory(m, o, g, b, zero=False),
    "ddp_zero1": lambda m, o, g, b: ddp_memory(m, o, g, b, zero=True),
    "stage1": lambda m, o, g, b: fsdp_memory(m, o, g, b, zero_stage=1),
    "stage2": lambda m, o, g, b: fsdp_memory(m, o, g, b, zero_stage=2),
    "stage3": lambda m, o, g, b: fsdp_memory(m, o, g, b, zero_stage=3, units=units),
    "stage3_keep": lambda m, o, g, b: fsdp_memory(m, o, g, b, zero_stage=3, units=units,
                                                  reshard_after_forward=False),
}


def plot(results: dict, path: Path) -> None:
    """Stacked bars per rank for each variant and N (as the ZeRO paper's Figure 1):
    parameters, optimizer state and XLA's temporaries (which hold the gradients, the
    gathered units and the activations), together about the step's peak."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    sizes = sorted({r["n"] for r in rows})
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, axes = plt.subplots(1, len(sizes), figsize=(4 * len(sizes), 4), sharey=True)
    for ax, n in zip(axes, sizes, strict=True):
        by = {r["variant"]: r for r in rows if r["n"] == n}
        bottom = [0.0] * len(variants)
        for part, label in (("params", "parameters"), ("opt_state", "optimizer state"),
                            ("temp", "temporaries (gradients, gathered units, activations)")):
            vals = [by[v][part] / 1024 for v in variants]
            ax.bar(variants, vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_title(f"N = {n}")
        ax.tick_params(axis="x", rotation=60)
    axes[0].set_ylabel("GiB per rank")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"{results['params'] / 1e6:.0f}M-parameter GPT, Adam (XLA memory analysis)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def table(rows, columns):
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="2,4,8")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--depths", default="12,24", help="stage-3 depths for the depth table")
    p.add_argument("--out", default=str(RESULTS / "fsdp_memory.json"))
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG from --out")
    args = p.parse_args()
    png = Path(args.out).with_suffix(".png")
    if args.plot_only:
        plot(json.loads(Path(args.out).read_text()), png)
        return
    jaxpg.init_process_group()
    optimizer = optax.adam(1e-4)
    model = nnx.eval_shape(lambda: GPT())
    count = n_params(model)
    rows, depth_rows = [], []
    t0 = time.time()
    for n in map(int, args.sizes.split(",")):
        group = jaxpg.new_group(list(range(n)))
        for name in args.variants.split(","):
            mem = VARIANTS[name](model, optimizer, group, PER_RANK)
            row = {"n": n, "variant": name, **{k: v / MIB for k, v in mem.as_dict().items()}}
            rows.append(row)
            print(f"N={n} {name}: state {row['state']:.0f} MiB, temp {row['temp']:.0f} MiB, "
                  f"peak {row['peak']:.0f} MiB ({time.time() - t0:.0f} s)", flush=True)
    unit = sum(x.size * 4 for x in jax.tree.leaves(nnx.state(model.blocks[0], nnx.Param)))
    for depth in map(int, args.depths.split(",")):
        deep = nnx.eval_shape(lambda d=depth: GPT(depth=d))
        for n in (4,):
            group = jaxpg.new_group(list(range(n)))
            for name in ("stage3", "stage3_keep", "ddp"):
                mem = VARIANTS[name](deep, optimizer, group, PER_RANK)
                depth_rows.append({"depth": depth, "n_params": n_params(deep), "n": n,
                                   "variant": name,
                                   **{k: v / MIB for k, v in mem.as_dict().items()}})
                print(f"depth {depth} N={n} {name}: temp {mem.temp / MIB:.0f} MiB, peak "
                      f"{mem.peak / MIB:.0f} MiB", flush=True)
    by = {(r["n"], r["variant"]): r for r in rows}
    for r in rows:
        r["state_over_ddp"] = r["state"] / by[(r["n"], "ddp")]["state"] if (
            r["n"], "ddp") in by else None
    out = {
        "when": datetime.datetime.now().isoformat(timespec="seconds"),
        "load_average": os.getloadavg(), "jax": jax.__version__, "params": count,
        "unit_bytes": unit, "per_rank_batch": PER_RANK, "seq": SEQ, "vocab": VOCAB,
        "optimizer": "adam", "rows": rows, "depth_rows": depth_rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    fmt = lambda r: {**r, **{k: f"{r[k]:.0f}" for k in ("params", "grads", "opt_state",
                                                        "state", "temp", "peak")},
                     "state_over_ddp": (f"{r['state_over_ddp']:.2f}"
                                        if r.get("state_over_ddp") else "")}
    plot(out, png)
    print(f"\n{count / 1e6:.1f}M parameters, unit (block) {unit / MIB:.1f} MiB, MiB per rank")
    print(table([fmt(r) for r in rows], ["n", "variant", "params", "grads", "opt_state",
                                         "state", "state_over_ddp", "temp", "peak"]))
    print()
    print(table([fmt(r) for r in depth_rows],
                ["depth", "n", "variant", "state", "temp", "peak"]))
    depths = sorted({r["depth"] for r in depth_rows})
    if len(depths) == 2:
        temp = {(r["depth"], r["variant"]): r["temp"] for r in depth_rows}
        grow = {v: (temp[depths[1], v] - temp[depths[0], v]) / (depths[1] - depths[0])
                for v in ("stage3", "stage3_keep", "ddp")}
        out["temp_growth_per_block_mib"] = grow
        Path(args.out).write_text(json.dumps(out, indent=1))
        print("temp growth per block (MiB): " + ", ".join(f"{k} {v:.1f}" for k, v in grow.items())
              + f"; a block's parameters: {unit / MIB:.1f}")


if __name__ == "__main__":
    main()
