"""GPU benchmark for the eager path and DDP, written to run on one GPU.

Parts, each in fresh processes:

* ``overhead``: an eager ``all_reduce`` against a hand-written jitted ``shard_map`` psum of
  the same array at 1 KB, 1 MB and 64 MB, in two layouts: one process
  (``init_process_group()``) and the torch layout with a world of one
  (``init_process_group(init_method="tcp://...", world_size=1, rank=0)``). Per call: the
  blocking time (median over interleaved rounds) and the time until the call returns.
* ``async``: ``all_reduce(y)`` and ``all_reduce(y, async_op=True)`` where ``y`` depends on
  about 30 ms of queued matmuls: on GPU both must return at once (stream-ordered); the
  record says how long each call took to return, whether ``y`` was still being computed,
  and that the result is right.
* ``watchdog``: a ``tcp://`` world of one with a 1 s group timeout and about 4 s of device
  work queued ahead of an ``all_reduce``: the call returns at once, and the watchdog must end
  the process with exit code 6 and the named ``DistTimeoutError`` on stderr.
* ``ddp``: one training step of a 25M-parameter MLP (1024-4096-4096-1024-10, batch 1024,
  SGD momentum 0.9, TF32 matmuls allowed on both sides): a plain ``jax.jit`` optax step,
  jaxpg ``DistributedDataParallel`` with the bucketed reducer and with one fused ``pmean``
  (world of one GPU), and torch DDP (nccl, world of one; gloo on CPU), medians over
  interleaved steps; every variant takes the batch already on the device.
* ``moe``: one step (``jax.grad`` in x, gate_w, w1, w2) of ``jaxpg.expert_parallel.moe`` at
  ep = 1 (``bench/_expert_parallel_single.py``'s step) for E = 8 and 16, in float32 and
  bfloat16: dropless with each grouped matmul the GPU runs (``xla``, ``tiled``, and
  ``mosaic`` on Hopper for bfloat16), the grouped matmuls alone, and capacity factor 1.25,
  against the floor: the same rows (tokens x top_k) through one dense FFN of the same
  width, which is what a grouped matmul that skips nothing would cost.
* ``zb``: the pipeline stage's pieces (``jaxpg.pipeline.stage.split``) of a residual tanh
  block, each its own jitted program on the one device: ``F``, the whole backward, and
  ZB's split ``B`` and ``W``; the question is whether ``B + W`` costs more than the whole
  backward (5-9% on CPU, docs/pipeline.md).

    python bench/gpu.py            # on the GPU machine: writes bench/results/gpu.json
    python bench/gpu.py --smoke    # small sizes on CPU to prove it runs: gpu.json's "smoke"
    python bench/gpu.py --parts moe --configuration moe_h200   # one part, its own entry

``--configuration NAME`` writes the run as that named configuration of ``gpu.json``
(``configurations.NAME``; ``--smoke`` defaults it to ``smoke``), beside the default run.

The smoke run's figures are CPU figures at toy sizes, not GPU measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import time
from pathlib import Path

from _launch import RESULTS, free_port, launch  # bench/ is sys.path[0]
from _results import add_flag, save
from _rounds import block, load_average, no_wait, run_rounds

FULL = {"sizes": [1 << 10, 1 << 20, 64 << 20], "layers": (1024, 4096, 4096, 1024, 10),
        "batch": 1024, "steps": 20, "warmup": 3, "rounds": 15, "matmul": 4096, "chain": 12,
        "moe": {"tokens": 8192, "dim": 1024, "ffn": 4096, "experts": [8, 16]},
        "zb": {"dims": [1024, 4096], "rows": [256, 2048]}, "spin": (16384, 4)}
SMOKE = {"sizes": [1 << 10, 64 << 10], "layers": (64, 128, 10), "batch": 32, "steps": 5,
         "warmup": 2, "rounds": 5, "matmul": 512, "chain": 20,
         "moe": {"tokens": 256, "dim": 64, "ffn": 128, "experts": [8]},
         "zb": {"dims": [128], "rows": [32]}, "spin": (1024, 20)}


def _init(layout: str) -> None:
    import jaxpg

    if layout == "tcp1":
        jaxpg.init_process_group(init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1,
                                 rank=0)
    else:
        jaxpg.init_process_group()


def part_overhead(cfg: dict, layout: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxpg

    _init(layout)
    dev = jax.local_devices()[0]
    mesh = Mesh(np.array([dev]), ("i",))
    hand = jax.jit(jax.shard_map(lambda x: lax.psum(x, "i"), mesh=mesh, in_specs=P("i"),
                                 out_specs=P("i")))
    rows = []
    for size in cfg["sizes"]:
        x = jax.device_put(jnp.ones(size // 4, jnp.float32), dev)
        glob = jax.device_put(x, NamedSharding(mesh, P("i")))
        fns = {"hand": lambda g=glob: hand(g), "eager": lambda x=x: jaxpg.all_reduce(x)}
        assert np.allclose(np.asarray(fns["eager"]()), np.asarray(fns["hand"]()))
        iters = max(2, min(200, (256 << 20) // size))
        blocked = run_rounds(fns, cfg["rounds"], iters=iters)
        # the time until a call returns, then waited for outside the timing
        returned = run_rounds(fns, cfg["rounds"] * min(iters, 20), wait=no_wait, settle=block)
        med = {k: v * 1e6 for k, v in blocked.medians().items()}
        rows.append({"layout": layout, "size_bytes": size, "block_us": med,
                     "return_us": {k: v * 1e6 for k, v in returned.medians().items()},
                     "overhead_us": med["eager"] - med["hand"], **blocked.loads()})
    rows_async = part_async(cfg, layout)
    jaxpg.destroy_process_group()
    return {"overhead": rows, "async": rows_async}


def _queued_work(cfg: dict):
    """``(queued, a)``: a jitted chain of ``cfg['chain']`` ``(m, m)`` matmuls
    (``m = cfg['matmul']``) and its input, ``queued`` and the ``(m, m)`` ``all_reduce``
    both compiled and run once (the process group must be initialized)."""
    import jax
    import jax.numpy as jnp

    import jaxpg

    m = cfg["matmul"]

    @jax.jit
    def queued(a):
        for _ in range(cfg["chain"]):
            a = jnp.tanh(a @ a) * 0.5
        return a

    a = jnp.full((m, m), 0.01, jnp.float32)
    queued(a).block_until_ready()
    jaxpg.all_reduce(a).block_until_ready()  # compile the (m, m) kernel before timing
    return queued, a


def part_async(cfg: dict, layout: str) -> dict:
    import numpy as np

    import jaxpg

    queued, a = _queued_work(cfg)
    jaxpg.all_reduce(a, async_op=True).wait()
    t0 = time.perf_counter()
    queued(a).block_until_ready()
    work_ms = (time.perf_counter() - t0) * 1e3
    out = {"layout": layout, "queued_work_ms": work_ms}
    for mode in ("plain", "async_op"):
        y = queued(a)
        t0 = time.perf_counter()
        res = jaxpg.all_reduce(y, async_op=mode == "async_op")
        out[f"{mode}_return_ms"] = (time.perf_counter() - t0) * 1e3
        out[f"{mode}_input_ready_at_return"] = bool(y.is_ready())
        value = res.result() if mode == "async_op" else res
        out[f"{mode}_correct"] = bool(np.allclose(np.asarray(value), np.asarray(y)))
    return out


def part_watchdog(cfg: dict) -> None:
    """A ``tcp://`` world of one with a 1 s group timeout and several seconds of device
    work queued ahead of an ``all_reduce``: the call returns at once and the watchdog must
    end the process (exit code 6) with the named error on stderr.

    The work is a few long calls (a chain of float32 matmuls, no TF32, each call about a
    second), not many short ones: a device runtime admits only so many programs in flight
    (dispatch then blocks), and a loop with a dynamic trip count makes the GPU's dispatch
    wait for it, so either would leave little or nothing queued when the ``all_reduce``
    comes."""
    import datetime

    import jax
    import jax.numpy as jnp

    import jaxpg

    jaxpg.init_process_group(init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1,
                             rank=0, timeout=datetime.timedelta(seconds=1))
    m, chain = cfg["spin"]

    @jax.jit
    def spin(a):
        for _ in range(chain):
            a = jnp.tanh(jnp.matmul(a, a, precision="highest")) * 0.5
        return a

    a = jnp.full((m, m), 0.01, jnp.float32)
    jaxpg.all_reduce(spin(a)).block_until_ready()  # both compiled before timing
    t0 = time.perf_counter()
    spin(a).block_until_ready()
    one = time.perf_counter() - t0
    y = a
    for _ in range(min(8, max(2, int(4.0 / one) + 1))):  # about 4 s, queued
        y = spin(y)
    t0 = time.perf_counter()
    y = jaxpg.all_reduce(y)
    print(f"RETURNED after {(time.perf_counter() - t0) * 1e3:.2f} ms; input ready: "
          f"{y.is_ready()}; one call of the queued work: {one * 1e3:.0f} ms", flush=True)
    time.sleep(30)
    print("WATCHDOG DID NOT FIRE", flush=True)


SMOKE_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}


def _watchdog_child(smoke: bool) -> dict:
    # the child must fail (exit code 6): check=False, its output judged here. Smoke: the
    # accelerator rules on CPU, through the same code
    env = {**SMOKE_ENV, "_JAXPG_STREAM_SEMANTICS": "1"} if smoke else {}
    done = launch(__file__, ["--part", "watchdog"] + (["--smoke"] if smoke else []),
                  env=env, platform="cpu" if smoke else None, timeout=300, check=False)
    lines = (done.output or "").splitlines()
    fired = [ln for ln in lines if "[jaxpg watchdog]" in ln]
    returned = [ln for ln in lines if ln.startswith("RETURNED")]
    return {"exit_code": done.returncode, "seconds": done.seconds,
            "returned": returned[0] if returned else None,
            "watchdog_message": fired[0] if fired else None,
            "ok": done.returncode == 6 and bool(fired)
            and re.search(r"all_reduce (#\d+ )?on group 'WORLD'", fired[0]) is not None}


def part_ddp(cfg: dict) -> dict:
    import jax
    import optax
    from _models import MLP, local_step, loss_fn, make_batch  # bench/ is sys.path[0]
    from flax import nnx

    import jaxpg
    from jaxpg.ddp import DistributedDataParallel

    jax.config.update("jax_default_matmul_precision", "tensorfloat32")
    jaxpg.init_process_group()
    group = jaxpg.new_group([0])
    layers, batch_n = cfg["layers"], cfg["batch"]
    batch = make_batch(batch_n, seed=0, layers=layers)

    tx = optax.sgd(0.01, momentum=0.9)
    graphdef, params = nnx.split(MLP(nnx.Rngs(0), layers))
    opt_state = tx.init(params)

    plain_step = jax.jit(local_step(graphdef, tx))

    dev_batch = jax.device_put(batch)
    state = {"plain": (params, opt_state)}

    def run_plain():
        state["plain"] = plain_step(*state["plain"], dev_batch)
        jax.block_until_ready(state["plain"])

    ddps = {name: DistributedDataParallel(MLP(nnx.Rngs(0), layers), tx, group=group, **kw)
            for name, kw in (("jaxpg DDP (buckets)", {}),
                             ("jaxpg DDP (fused pmean)", {"reduction": "fused_pmean"}))}
    fns = {"plain jax.jit optax": run_plain}
    for name, ddp in ddps.items():
        fns[name] = (lambda d: lambda: (d.train_step(loss_fn, dev_batch),  # on the GPU, as torch's
                                        jax.block_until_ready(d.params)))(ddp)
    timed = run_rounds(fns, cfg["steps"], warmup=cfg["warmup"])
    out = {k: {"step_ms": t * 1e3, "samples_per_s": batch_n / t}
           for k, t in timed.medians().items()}
    out.update(timed.loads())
    out["params"] = sum(a * b + b for a, b in zip(layers[:-1], layers[1:], strict=True))
    out["buckets"] = len(ddps["jaxpg DDP (buckets)"].bucket_plan)
    jaxpg.destroy_process_group()
    return out


def part_torch(cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dist.init_process_group("nccl" if cuda else "gloo",
                            init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    dev = torch.device("cuda:0" if cuda else "cpu")
    torch.manual_seed(0)
    from _models import make_batch, torch_mlp  # bench/ is sys.path[0]

    layers, batch_n = cfg["layers"], cfg["batch"]
    model = torch.nn.parallel.DistributedDataParallel(
        torch_mlp(layers).to(dev), bucket_cap_mb=25, device_ids=[0] if cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = make_batch(batch_n, seed=0, layers=layers)
    x = torch.from_numpy(batch["x"]).to(dev)
    y = torch.from_numpy(batch["y"]).long().to(dev)
    def step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def wait(_):
        if cuda:
            torch.cuda.synchronize()

    timed = run_rounds({"torch DDP": step}, cfg["steps"], warmup=cfg["warmup"], wait=wait)
    dist.destroy_process_group()
    ms = timed.medians()["torch DDP"] * 1e3
    return {"torch DDP": {"step_ms": ms, "samples_per_s": batch_n / ms * 1e3,
                          "backend": "nccl" if cuda else "gloo", "torch": torch.__version__,
                          **timed.loads()}}


def _moe_row(experts: int, shape: argparse.Namespace, rounds: int) -> dict:
    """One E's row, in float32 and bfloat16: the moe step with each grouped matmul this GPU
    runs (dropless), with capacity 1.25 ("auto"), the grouped matmuls alone on the routed
    rows (even groups), and the dense floor."""
    import jax
    import jax.numpy as jnp
    from _expert_parallel_single import AUX_WEIGHT, inputs, moe_step  # bench/ is sys.path[0]

    from jaxpg.expert_parallel.dispatch import expert_ffn
    from jaxpg.expert_parallel.grouped_matmul import mosaic_applies

    top_k = 2
    fns, impls_run = {}, {}
    for dtype in (jnp.float32, jnp.bfloat16):
        name = jnp.dtype(dtype).name
        a = tuple(jnp.asarray(v, dtype) for v in inputs(1, experts, shape))
        x, w1, w2, cot = a[0][0], a[2][0, 0], a[3][0, 0], a[4][0]
        xr = jnp.concatenate([x] * top_k)  # as many rows as dropless sends to the experts
        cr = jnp.concatenate([cot] * top_k)

        @jax.jit
        def floor(xr, w1, w2, cr):
            def loss(xr, w1, w2):
                return jnp.sum((jax.nn.gelu(xr @ w1) @ w2) * cr) + AUX_WEIGHT
            return jax.grad(loss, argnums=(0, 1, 2))(xr, w1, w2)

        we1, we2 = a[2][0], a[3][0]
        sizes = jnp.full((experts,), xr.shape[0] // experts, jnp.int32)
        impls = ["xla", "tiled"] + ([] if mosaic_applies(we1, we2) else ["mosaic"])
        impls_run[name] = impls
        for impl in impls:
            @jax.jit
            def grouped(xr, we1, we2, cr, impl=impl, sizes=sizes):
                def loss(xr, we1, we2):
                    return jnp.sum(expert_ffn(xr, we1, we2, sizes, jax.nn.gelu, impl) * cr)
                return jax.grad(loss, argnums=(0, 1, 2))(xr, we1, we2)

            step = moe_step(1, top_k, None, grouped_matmul=impl)
            fns[f"{name} dropless {impl}"] = lambda step=step, a=a: step(*a)
            fns[f"{name} grouped {impl}"] = (
                lambda g=grouped, xr=xr, we1=we1, we2=we2, cr=cr: g(xr, we1, we2, cr))
        capacity = moe_step(1, top_k, 1.25)
        fns[f"{name} capacity 1.25 auto"] = lambda step=capacity, a=a: step(*a)
        fns[f"{name} dense floor"] = (
            lambda f=floor, xr=xr, w1=w1, w2=w2, cr=cr: f(xr, w1, w2, cr))
    timed = run_rounds(fns, rounds, iters=5, warmup=1)
    ms = {k: v * 1e3 for k, v in timed.medians().items()}
    over_floor = {k: v / ms[f"{k.split()[0]} dense floor"] for k, v in ms.items()}
    return {"experts": experts, "top_k": top_k, "impls": impls_run, "step_ms": ms,
            "over_dense_floor": over_floor, **timed.loads()}


def part_moe(cfg: dict) -> dict:
    import os

    # _expert_parallel_single defaults JAX_PLATFORMS to cpu; the child's own platform rules
    os.environ.setdefault("JAX_PLATFORMS", "")
    import jaxpg

    jaxpg.init_process_group()
    shape = argparse.Namespace(**{k: cfg["moe"][k] for k in ("tokens", "dim", "ffn")})
    rows = [_moe_row(e, shape, min(cfg["rounds"], 7)) for e in cfg["moe"]["experts"]]
    jaxpg.destroy_process_group()
    return {"shape": {**cfg["moe"], "ep": 1}, "rows": rows}


def _zb_row(dim: int, n: int, rounds: int) -> dict:
    """The stage pieces of one residual tanh block of width ``dim`` on ``n`` rows."""
    from _stage_pieces import piece_variants  # bench/ is sys.path[0]

    timed = run_rounds(piece_variants(dim, n), rounds, iters=50, warmup=2)
    us = {k: v * 1e6 for k, v in timed.medians().items()}
    return {"dim": dim, "rows": n, "us": us,
            "split_over_whole": (us["B split"] + us["W"]) / us["B whole"]}


def part_zb(cfg: dict) -> dict:
    return {"rows": [_zb_row(d, n, cfg["rounds"]) for d in cfg["zb"]["dims"]
                     for n in cfg["zb"]["rows"]]}


PARTS = {"ddp": part_ddp, "torch": part_torch, "moe": part_moe, "zb": part_zb}  # in a child
ALL_PARTS = ("overhead", "watchdog", *PARTS)
RESULT_KEY = {"torch": "torch_ddp"}  # a part's key in the results, where not its name


def _child(part: str, layout: str, smoke: bool, out: Path) -> dict:
    # a part that fails is recorded as its error, and the others still run: check=False
    done = launch(__file__, ["--part", part, "--layout", layout, "--out", out]
                  + (["--smoke"] if smoke else []), env=SMOKE_ENV if smoke else {},
                  platform="cpu" if smoke else None, timeout=1200, check=False)
    if done.returncode != 0:
        return {"error": done.tail(60)}
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (proves it runs)")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--layout", default="single", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    p.add_argument("--parts", nargs="+", default=list(ALL_PARTS), choices=ALL_PARTS,
                   help="which parts to run (default: all)")
    add_flag(p)
    args = p.parse_args()
    cfg = SMOKE if args.smoke else FULL
    if args.part == "watchdog":
        part_watchdog(cfg)
        return
    if args.part:
        if args.part == "overhead":
            result = part_overhead(cfg, args.layout)
        else:
            result = PARTS[args.part](cfg)
        Path(args.out).write_text(json.dumps(result))
        return
    out = Path(args.out or RESULTS / "gpu.json")
    configuration = args.configuration or ("smoke" if args.smoke else None)
    tmp = out.with_suffix(".part.json")
    result = {"command": "python bench/gpu.py" + (" --smoke" if args.smoke else "")
              + ("" if args.parts == list(ALL_PARTS) else " --parts " + " ".join(args.parts)),
              "smoke": args.smoke, "config": {k: list(v) if isinstance(v, tuple) else v
                                              for k, v in cfg.items()},
              "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
              "load_average_before": load_average()}
    for part in args.parts:
        if part == "overhead":
            for layout in ("single", "tcp1"):
                result[f"overhead_{layout}"] = _child("overhead", layout, args.smoke, tmp)
        elif part == "watchdog":
            result["watchdog"] = _watchdog_child(args.smoke)
        else:
            result[RESULT_KEY.get(part, part)] = _child(part, "single", args.smoke, tmp)
    tmp.unlink(missing_ok=True)
    import jax

    result["jax"] = jax.__version__
    result["load_average_after"] = load_average()
    save(out, result, configuration)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
