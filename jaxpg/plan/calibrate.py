"""``calibrate()``: measure this machine's devices into a ``local`` hardware profile.

It times, on every local device at once (what a layout's devices do in a step):

* a matmul on each device: the FLOP/s the profile calls peak (so ``matmul_efficiency`` is
  1: the measurement already is what matmuls reach), and two narrow ones (widths 16 and
  64), whose slowdown gives ``matmul_half_width``;
* an elementwise pass over a large array on each device: the memory bandwidth;
* chains of 33 kernels against one, each kernel a reduction and an elementwise pass, at
  two sizes 4x apart: the fixed cost of an operation, ``op_overhead`` (the part of a
  kernel's time its size does not explain: what a step of many kernels pays beyond their
  work);
* an all-reduce over all devices at two sizes: its bandwidth, from the alpha-beta model
  (:mod:`jaxpg.plan.links`), as the link within the "node" (this machine), with
  ``collective_efficiency`` 1 for the same reason; and, for each kind a step is made of
  (all-gather, reduce-scatter, all-reduce), 16 small ones in a row in one program: the
  link's latency (what each collective of a program pays, not a program's launch);
* on CPU devices, ``overlap=False``: XLA:CPU runs one operation at a time;
* whether the compiler merges two parameters' all-gathers into one
  (:func:`collectives_per_tensor`, read from a compiled program, not timed);
* whether jaxpg runs an MoE's experts as one tiled loop there (:func:`experts_fused`).

The clock depends on the devices. GPU and TPU devices are each their own hardware: they are
timed by wall clock, each rate is one device's. Simulated CPU devices
(``--xla_force_host_platform_device_count``) are threads of this process sharing the host's
cores: they are timed by the process's CPU time, all devices' work together divided by
their number, so each rate is what one device's work gets from one core, whatever else
the machine runs. A step's prediction on such a profile is then one device's CPU seconds,
what :func:`jaxpg.plan.trial.trial_times` measures as its CPU time over the devices; on an
idle machine its wall time is about that times the devices over the cores.

Example:
    >>> hw = calibrate(repeats=2, matmul_size=128)   # doctest: +SKIP
"""

from __future__ import annotations

import os
import time

from jaxpg.plan.hardware import Hardware, Link

__all__ = ["calibrate", "calibrate_link", "collectives_per_tensor"]


def _best_seconds(fn, *args, repeats: int, cpu: bool) -> float:
    """The fastest of ``repeats`` timed runs (after a warm-up): on a shared machine the
    fastest run is the one least disturbed by other work. ``cpu``: this process's CPU
    seconds, all its threads together (simulated CPU devices are its threads), in place of
    wall time."""
    import jax

    clock = time.process_time if cpu else time.perf_counter
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        begin = clock()
        jax.block_until_ready(fn(*args))
        samples.append(clock() - begin)
    return max(min(samples), 1e-9)


def _host_bytes() -> float:
    try:
        return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 16.0 * 2**30


def calibrate(*, devices=None, dtype: str = "bf16", matmul_size: int = 512,
              stream_mib: int = 32, repeats: int = 5, name: str = "local") -> Hardware:
    """Measures ``devices`` (default: all local ones) into a :class:`Hardware` profile.

    CPU devices are timed by this process's CPU time over their number (one device's
    work), other devices by wall clock (the module's docstring says why).

    Args:
        devices: the devices to measure together.
        dtype: the dtype of the matmul (``"bf16"`` or ``"fp32"``).
        matmul_size: the square matmul's size per device.
        stream_mib: MiB per device of the bandwidth pass.
        repeats: timed runs per measurement (the fastest is kept).
        name: the profile's name.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = list(devices or jax.local_devices())
    n = len(devices)
    cpu = devices[0].platform == "cpu"
    # by CPU time, the work of all n devices over the CPU seconds is one core's rate: the
    # n devices' seconds divided by n are one device's
    share = n if cpu else 1

    def seconds(fn, *args) -> float:
        """One device's seconds for ``fn`` run on all devices at once."""
        return _best_seconds(fn, *args, repeats=repeats, cpu=cpu) / share

    mesh = Mesh(np.array(devices), ("d",))
    spec = NamedSharding(mesh, PartitionSpec("d"))
    jdtype = {"bf16": jnp.bfloat16, "fp32": jnp.float32, "fp16": jnp.float16}[dtype]

    matmul = jax.jit(lambda x, w: jnp.einsum("bij,bjk->bik", x, w), out_shardings=spec)

    def matmul_flops(rows: int, width: int) -> float:
        x = jax.device_put(jnp.ones((n, rows, matmul_size), jdtype), spec)
        w = jax.device_put(jnp.ones((n, matmul_size, width), jdtype), spec)
        return 2.0 * rows * matmul_size * width / seconds(matmul, x, w)

    flops = matmul_flops(matmul_size, matmul_size)
    # narrow matmuls (widths 16 and 64): w / (w + half) = their throughput over the square
    # one's; the half width is the mean of the two estimates
    halves = []
    for narrow in (16, 64):
        ratio = min(matmul_flops(matmul_size, narrow) / flops, 0.999)
        halves.append(narrow * (1 - ratio) / ratio)
    half_width = sum(halves) / len(halves)

    words = stream_mib * 2**20 // 4
    s = jax.device_put(jnp.ones((n, words), jnp.float32), spec)
    stream = jax.jit(lambda x: x * 1.5 + 1.0, out_shardings=spec)
    bandwidth = 2.0 * words * 4 / seconds(stream, s)

    def kernels(count: int):
        """``count`` kernels in a row: each a reduction and the elementwise pass after it
        (one fused kernel), over an activation-sized array."""
        def chain(v):
            for _ in range(count):
                v = jnp.sum(v, axis=0, keepdims=True) * 1e-3 + v
            return v
        return jax.jit(chain, out_shardings=spec)

    def per_kernel(rows: int) -> float:
        """One kernel's seconds over ``rows x 128`` words a device: 33 against one."""
        v = jax.device_put(jnp.ones((n * rows, 128), jnp.float32), spec)
        return (seconds(kernels(33), v) - seconds(kernels(1), v)) / 32

    # a kernel's seconds are a fixed cost plus its work, linear in its size: the fixed cost
    # from two sizes, 4x apart (the step's kernels are of such sizes, where each pays it)
    op_overhead = max((4 * per_kernel(16) - per_kernel(64)) / 3, 0.0)

    if n > 1:
        link = calibrate_link(devices=devices, repeats=repeats)
    else:
        link = Link(bandwidth=bandwidth, latency=1e-6)
    return Hardware(name=name, flops={dtype: flops}, hbm_bytes=_host_bytes() / n,
                    hbm_bandwidth=bandwidth, intra=link, inter=link, devices_per_node=n,
                    matmul_efficiency=1.0, collective_efficiency=1.0,
                    matmul_half_width=half_width, overlap=not cpu, op_overhead=op_overhead,
                    per_tensor_collectives=collectives_per_tensor(devices=devices),
                    fused_expert_mlp=experts_fused())


def experts_fused() -> bool:
    """Whether ``jaxpg.expert_parallel.moe`` runs its experts' MLP as one tiled loop on
    the default backend (``grouped_matmul="auto"`` resolving to ``"tiled"``), as
    :attr:`Hardware.fused_expert_mlp` records."""
    import jax

    from jaxpg.expert_parallel.grouped_matmul import resolve_grouped_matmul

    rows, experts = (jax.ShapeDtypeStruct(s, "float32") for s in ((8, 128), (2, 128, 128)))
    return resolve_grouped_matmul("auto", rows, experts) == "tiled"


def collectives_per_tensor(*, devices=None) -> bool:
    """Whether XLA leaves one all-gather per parameter on ``devices``: compiles a program
    that gathers two independent parameters sharded over them (as FSDP gathers a unit's)
    and counts the all-gathers in it. XLA:CPU keeps both; XLA's GPU and TPU combiners
    merge them into one. False on one device (nothing to gather).
    """
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = list(devices or jax.local_devices())
    if len(devices) < 2:
        return False
    mesh = Mesh(np.array(devices), ("d",))
    split, whole = NamedSharding(mesh, PartitionSpec("d")), NamedSharding(mesh, PartitionSpec())
    rows = 8 * len(devices)

    def use(a, b, x):
        a, b = (jax.lax.with_sharding_constraint(w, whole) for w in (a, b))
        return (x @ a) @ b

    w = jax.ShapeDtypeStruct((rows, rows), jnp.float32, sharding=split)
    x = jax.ShapeDtypeStruct((4, rows), jnp.float32, sharding=whole)
    text = jax.jit(use, out_shardings=whole).lower(w, w, x).compile().as_text()
    # the instructions (an op, or an async op's start), not their names or uses
    return len(re.findall(r"\sall-gather(?:-start)?\(", text)) > 1


def calibrate_link(*, devices=None, repeats: int = 5) -> Link:
    """Measures the link between ``devices`` (default: all local ones; all of them must
    join, each process calling it with the same list): an all-reduce at two sizes for the
    bandwidth, chains of small all-gathers, reduce-scatters and all-reduces for the
    latency (the module's docstring).

    Over the devices of several processes this is the link between them, which a profile
    of several processes keeps as ``inter`` (its ``devices_per_node`` a process's
    devices). On CPU devices each process times its own CPU seconds over its own devices
    among ``devices``.

    Args:
        devices: two or more devices, in the same order on every process.
        repeats: timed runs per measurement (the fastest is kept).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = list(devices or jax.local_devices())
    n = len(devices)
    if n < 2:
        raise ValueError(f"calibrate_link: {n} device(s) given; a link needs two or more.")
    cpu = devices[0].platform == "cpu"
    share = sum(d.process_index == jax.process_index() for d in devices) if cpu else 1
    mesh = Mesh(np.array(devices), ("d",))
    spec = NamedSharding(mesh, PartitionSpec("d"))

    def collective_seconds(kind: str, count: int, chain: int = 1) -> float:
        """One program of ``chain`` collectives of ``kind`` in a row (each waits for the
        previous one) over ``count`` float32 words per device (the full buffer)."""
        def one(v):
            if kind == "all_reduce":
                return jax.lax.psum(v, "d") * 0.5
            if kind == "all_gather":  # a parameter's shard gathered, then used
                return jax.lax.all_gather(v[: count // n], "d", tiled=True) * 0.5
            # a gradient reduce-scattered, its shard then used
            return jnp.tile(jax.lax.psum_scatter(v, "d", tiled=True), n) * 0.5

        def body(v):
            for _ in range(chain):
                v = one(v[0])[None]
            return v

        x = jax.device_put(jnp.ones((n, count), jnp.float32), spec)
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec("d"),
                                   out_specs=PartitionSpec("d")))
        return _best_seconds(fn, x, repeats=repeats, cpu=cpu) / share

    small, large = 1024 * n, 4 * 2**20 // 4
    t_small = collective_seconds("all_reduce", small)
    t_large = collective_seconds("all_reduce", large)
    per_byte = max(t_large - t_small, 1e-9) / ((large - small) * 4)
    beta = 2 * (n - 1) / n / per_byte
    # the latency inside a program, from the collectives a layout's step is made of
    # (ZeRO-3's parameter all-gathers and gradient reduce-scatters, tp's all-reduces): 16
    # small ones of each kind in a row, less one program's, per op and rank step
    alphas = []
    for kind, steps in (("all_gather", n - 1), ("reduce_scatter", n - 1),
                        ("all_reduce", 2 * (n - 1))):
        chained = (collective_seconds(kind, small, chain=17)
                   - collective_seconds(kind, small))
        wire = steps / n * small * 4 / beta
        alphas.append(max(chained / 16 - wire, 1e-7) / steps)
    return Link(bandwidth=beta, latency=sum(alphas) / len(alphas))
