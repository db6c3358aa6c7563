"""``calibrate()``: measure this machine's devices into a ``local`` hardware profile.

It times, on every local device at once (what a layout's devices do in a step):

* a matmul on each device: the per-device FLOP/s the profile calls peak (so
  ``matmul_efficiency`` is 1: the measurement already is what matmuls reach), and a narrow
  one (width 16), whose slowdown gives ``matmul_half_width``;
* an elementwise pass over a large array on each device: the memory bandwidth;
* an all-reduce over all devices at two sizes: its bandwidth, from the alpha-beta model
  (:mod:`jaxpg.plan.links`), as the link within the "node" (this machine), with
  ``collective_efficiency`` 1 for the same reason; and 16 small ones in a row in one
  program: its latency (what each collective of a program pays, not a program's launch);
* on CPU devices, ``overlap=False``: XLA:CPU runs one operation at a time.

Simulated CPU devices (``--xla_force_host_platform_device_count``) share the host's cores;
measuring them all at once charges each its share, which is what a step on them gets.

Example:
    >>> hw = calibrate(repeats=2, matmul_size=128)   # doctest: +SKIP
"""

from __future__ import annotations

import os
import time

from jaxpg.plan.hardware import Hardware, Link

__all__ = ["calibrate"]


def _best_seconds(fn, *args, repeats: int) -> float:
    """The fastest of ``repeats`` timed runs (after a warm-up): on a shared machine the
    fastest run is the one least disturbed by other work."""
    import jax

    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        begin = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - begin)
    return min(samples)


def _host_bytes() -> float:
    try:
        return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 16.0 * 2**30


def calibrate(*, devices=None, dtype: str = "bf16", matmul_size: int = 512,
              stream_mib: int = 32, repeats: int = 5, name: str = "local") -> Hardware:
    """Measures ``devices`` (default: all local ones) into a :class:`Hardware` profile.

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
    mesh = Mesh(np.array(devices), ("d",))
    spec = NamedSharding(mesh, PartitionSpec("d"))
    jdtype = {"bf16": jnp.bfloat16, "fp32": jnp.float32, "fp16": jnp.float16}[dtype]

    matmul = jax.jit(lambda x, w: jnp.einsum("bij,bjk->bik", x, w), out_shardings=spec)

    def matmul_flops(rows: int, width: int) -> float:
        x = jax.device_put(jnp.ones((n, rows, matmul_size), jdtype), spec)
        w = jax.device_put(jnp.ones((n, matmul_size, width), jdtype), spec)
        return 2.0 * rows * matmul_size * width / _best_seconds(matmul, x, w,
                                                                   repeats=repeats)

    flops = matmul_flops(matmul_size, matmul_size)
    # a narrow matmul (width 16): w / (w + half) = its throughput over the square one's
    narrow = 16
    ratio = min(matmul_flops(matmul_size, narrow) / flops, 0.999)
    half_width = narrow * (1 - ratio) / ratio

    words = stream_mib * 2**20 // 4
    s = jax.device_put(jnp.ones((n, words), jnp.float32), spec)
    stream = jax.jit(lambda x: x * 1.5 + 1.0, out_shardings=spec)
    bandwidth = 2.0 * words * 4 / _best_seconds(stream, s, repeats=repeats)

    def all_reduce_seconds(count: int, chain: int = 1) -> float:
        def body(v):
            for _ in range(chain):  # one after another: each waits for the previous one
                v = jax.lax.psum(v, "d") * 0.5
            return v

        x = jax.device_put(jnp.ones((n, count), jnp.float32), spec)
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec("d"),
                                   out_specs=PartitionSpec("d")))
        return _best_seconds(fn, x, repeats=repeats)

    if n > 1:
        small, large = 1024, 4 * 2**20 // 4
        t_small, t_large = all_reduce_seconds(small), all_reduce_seconds(large)
        per_byte = max(t_large - t_small, 1e-9) / ((large - small) * 4)
        beta = 2 * (n - 1) / n / per_byte
        # the latency inside a program: 16 small all-reduces in a row, less one program's
        chained = all_reduce_seconds(small, chain=17) - t_small
        alpha = max(chained / 16 - 2 * (n - 1) / n * small * 4 / beta, 1e-7) / (2 * (n - 1))
    else:
        beta, alpha = bandwidth, 1e-6
    link = Link(bandwidth=beta, latency=alpha)
    return Hardware(name=name, flops={dtype: flops}, hbm_bytes=_host_bytes() / n,
                    hbm_bandwidth=bandwidth, intra=link, inter=link, devices_per_node=n,
                    matmul_efficiency=1.0, collective_efficiency=1.0,
                    matmul_half_width=half_width,
                    overlap=devices[0].platform != "cpu")
